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
