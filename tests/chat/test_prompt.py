from app.chat.prompt import ChatPrompt, Message

HISTORY = [
    Message("system", "Be brief."),
    Message("user", "What is the capital of France?"),
    Message("assistant", "Paris is the capital."),
    Message("user", "And of Italy?"),
]


def reference(tokenizer, messages):
    return list(
        tokenizer.apply_chat_template(
            [m.to_dict() for m in messages], add_generation_prompt=True, return_dict=False
        )
    )


def test_plain_render_equals_the_chat_template(tokenizer):
    assert ChatPrompt(tokenizer).render(HISTORY) == reference(tokenizer, HISTORY)


def test_generated_ids_are_spliced_in_place_of_the_reply(tokenizer):
    prompt = ChatPrompt(tokenizer)
    reply = "Paris is the capital."
    natural = tokenizer.encode(reply, add_special_tokens=False)
    # The same text as the model might have produced it: "Par" + "is" + ... .
    pieces = tokenizer.encode("Par", add_special_tokens=False) + tokenizer.encode(
        "is is the capital.", add_special_tokens=False
    )
    assert pieces != natural and tokenizer.decode(pieces) == reply
    spliced = prompt.render(HISTORY, {reply: pieces})
    plain = prompt.render(HISTORY)
    assert spliced != plain

    # The reply is exactly the model's ids; the text around it is unchanged.
    def contains(seq, sub):
        return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))

    assert contains(spliced, pieces) and not contains(plain, pieces)
    assert tokenizer.decode(spliced) == tokenizer.decode(plain)
    # Ids equal to the natural tokenization change nothing.
    assert prompt.render(HISTORY, {reply: natural}) == plain


def test_a_conversations_next_prompt_tokenizes_its_new_message_only(tokenizer, monkeypatch):
    import app.chat.prompt as prompt_module

    prompt = ChatPrompt(tokenizer)
    encoded: list[str] = []
    real = tokenizer.encode

    def counting(text, **kw):
        encoded.append(text)
        return real(text, **kw)

    monkeypatch.setattr(tokenizer, "encode", counting)
    reply = "Paris is the capital."
    generated = {reply: real(reply, add_special_tokens=False)}
    first = prompt.render(HISTORY[:2])
    second = prompt.render(HISTORY, generated)
    third = [*HISTORY, Message("assistant", "Rome."), Message("user", "And Spain?")]
    generated["Rome."] = real("Rome.", add_special_tokens=False)
    again = prompt.render(third, generated)
    # The first prompt whole; then only what each turn added after its last reply (the text
    # before the first reply is the first prompt, kept).
    assert len(encoded) == 3
    assert "And of Italy?" in encoded[1] and "France" not in encoded[1]
    assert "And Spain?" in encoded[2] and "Italy" not in encoded[2]
    # Kept ids are the ids: a fresh prompt (no cache) renders the same.
    fresh = ChatPrompt(tokenizer)
    assert first == fresh.render(HISTORY[:2])
    assert second == fresh.render(HISTORY, generated) == reference(tokenizer, HISTORY)
    assert again == ChatPrompt(tokenizer).render(third, generated)
    # Bounded: past its budget the oldest pieces go.
    monkeypatch.setattr(prompt_module, "PIECES_KEPT_CHARS", 400)
    small = ChatPrompt(tokenizer)
    for i in range(20):
        small.render([Message("user", f"question {i} " * 3)])
    assert small._pieces_chars <= 400 and len(small._pieces) < 20
