"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE): whole characters
only, stop strings cut exactly, special tokens, and a decode window that does not grow."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from app.engine.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer

FFFD = "\ufffd"
ENDOFTEXT, IM_START, IM_END = 0, 1, 2

TEXTS = [
    "Hello, world! Plain ASCII, nothing to hold back.",
    "Emoji: 😀🎉🚀 and a family 👨‍👩‍👧‍👦 and a rainbow flag 🏳️‍🌈 and skin tone 👍🏽.",
    "Flags: 🇯🇵🇺🇸🇫🇷🇧🇷 in a row, then 🇩🇪.",
    "日本語のテキストを処理するのは難しいです。東京都庁舎は新宿区にあります。",
    "中华人民共和国成立于一九四九年。我们今天学习自然语言处理。",
    "한국어 텍스트 처리는 어렵습니다. 안녕하세요 세계",
    "Accents: café, naïve, façade, Ångström, Œuvre, żółć, čeština.",
    "مرحبا بالعالم، هذا اختبار للنص العربي",
    "नमस्ते दुनिया, यह एक परीक्षण है। हिन्दी भाषा",
    "def f(x):\n\tif x:\n        return {'a': [1, 2]}\n\n\n    # trailing   spaces   \r\n",
    "Mixed: résumé 履歴書 🧑🏿‍💻 кириллица ภาษาไทย 𝕳𝖊𝖑𝖑𝖔 𓀀 — “quotes” …",
]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer, ids: Sequence[int]) -> str:
    """What the detokenizer must add up to with its default skip_special_tokens=True."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def feed(
    tokenizer,
    ids: Sequence[int],
    sizes: Sequence[int] | None = None,
    stop: Sequence[str] = (),
    skip_special_tokens: bool = True,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `ids` in chunks of `sizes` (default: one at a time); return the deltas (the last
    one from flush()) and the detokenizer. Checks on the way that `text` is the sum."""
    detok = IncrementalDetokenizer(tokenizer, stop, skip_special_tokens)
    deltas: list[str] = []
    pos = 0
    for size in sizes or [1] * len(ids):
        deltas.append(detok.add_tokens(ids[pos : pos + size]))
        pos += size
        assert detok.text == "".join(deltas)
    assert pos == len(ids)
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas, detok


def random_sizes(n: int, rng: random.Random, largest: int = 7) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(min(rng.randint(1, largest), n - sum(sizes)))
    return sizes


def test_texts_really_split_characters_over_tokens(tokenizer) -> None:
    # Without this the tests below could pass with a detokenizer that never holds anything.
    ids = encode(tokenizer, "".join(TEXTS))
    cuts = [tokenizer.decode(ids[:i]) for i in range(1, len(ids))]
    assert sum(c.endswith(FFFD) for c in cuts) > 20


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_decode(tokenizer, text: str) -> None:
    ids = encode(tokenizer, text)
    deltas, _ = feed(tokenizer, ids)
    assert "".join(deltas) == decode(tokenizer, ids) == text
    assert not any(FFFD in d for d in deltas)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks_match_decode(tokenizer, text: str, seed: int) -> None:
    ids = encode(tokenizer, text)
    deltas, _ = feed(tokenizer, ids, random_sizes(len(ids), random.Random(seed)))
    assert "".join(deltas) == decode(tokenizer, ids)
    assert not any(FFFD in d for d in deltas)


def test_all_at_once_and_empty_calls(tokenizer) -> None:
    ids = encode(tokenizer, TEXTS[1])
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_tokens([]) == ""
    assert detok.add_tokens(ids) + detok.flush() == TEXTS[1]
    assert detok.flush() == ""


def test_incomplete_character_is_held_then_emitted_whole(tokenizer) -> None:
    ids = encode(tokenizer, "a🎉")
    assert len(ids) > 2  # the emoji spans several tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add_tokens([i]) for i in ids]
    assert deltas[0] == "a"
    assert deltas[1:-1] == [""] * (len(ids) - 2)
    assert deltas[-1] == "🎉"


def test_decode_window_does_not_grow_with_output(tokenizer) -> None:
    class CountingTokenizer:
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            self.lengths.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = encode(tokenizer, " ".join(TEXTS) * 4)
    assert len(ids) > 1500
    counting = CountingTokenizer()
    detok = IncrementalDetokenizer(counting)
    for i in ids:
        before = len(counting.lengths)
        detok.add_tokens([i])
        assert len(counting.lengths) - before <= 2  # the window, and its context
    assert max(counting.lengths) <= 2 * MAX_PENDING_TOKENS
    assert detok.text + detok.flush() == decode(tokenizer, ids)


def byte_tokens(tokenizer, data: bytes) -> list[int]:
    """One token per byte. Byte-level BPE writes each byte as a printable character: the
    printable Latin-1 bytes as themselves, the others as chr(256 + n) in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    ids = [tokenizer.convert_tokens_to_ids(char[b]) for b in data]
    assert tokenizer.unk_token_id not in ids, "a byte missing from the vocabulary"
    return ids


def test_byte_tokens_helper(tokenizer) -> None:
    assert tokenizer.decode(byte_tokens(tokenizer, "hi é🎉".encode())) == "hi é🎉"


def test_invalid_bytes_do_not_stall_the_stream(tokenizer) -> None:
    garbage = byte_tokens(tokenizer, b"\x80" * (3 * MAX_PENDING_TOKENS))
    after = encode(tokenizer, " back to normal 日本")
    detok = IncrementalDetokenizer(tokenizer)
    for i in garbage:
        detok.add_tokens([i])
    assert detok.text == FFFD * len(detok.text)
    assert len(detok.text) >= len(garbage) - MAX_PENDING_TOKENS  # out before any valid text
    for i in after:
        detok.add_tokens([i])
    assert detok.text.endswith(" back to normal 日本")
    assert detok.text + detok.flush() == decode(tokenizer, garbage + after)


@pytest.mark.parametrize("special_at", [None, 1, 2, 3])
@pytest.mark.parametrize("n_garbage", range(2 * MAX_PENDING_TOKENS))
def test_forced_emission_never_breaks_a_character_still_to_come(
    tokenizer, n_garbage: int, special_at: int | None
) -> None:
    # Invalid bytes force text out while the start of 🎉 is pending, perhaps with a skipped
    # special token inside it; the emoji must still come out whole.
    party = byte_tokens(tokenizer, "🎉".encode())
    if special_at is not None:
        party.insert(special_at, ENDOFTEXT)
    ids = byte_tokens(tokenizer, b"\x80" * n_garbage) + party
    for sizes in (None, random_sizes(len(ids), random.Random(n_garbage), largest=5)):
        deltas, _ = feed(tokenizer, ids, sizes)
        assert "".join(deltas) == decode(tokenizer, ids)
        assert "".join(deltas[:-1]).endswith("🎉")


def test_invalid_bytes_at_the_end_come_out_in_flush(tokenizer) -> None:
    ids = encode(tokenizer, "ok") + byte_tokens(tokenizer, b"\x80\xf0\x9f")
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add_tokens([i]) for i in ids) == "ok"
    assert detok.flush() == FFFD * 2


def test_add_tokens_after_flush_raises(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    detok.flush()
    with pytest.raises(RuntimeError, match="after flush"):
        detok.add_tokens([42])


@pytest.mark.parametrize("stop", [[""], "STOP", [None]])
def test_bad_stop_strings_are_refused(tokenizer, stop) -> None:
    with pytest.raises((ValueError, TypeError)):
        IncrementalDetokenizer(tokenizer, stop)


def stop_run(tokenizer, pieces: Sequence[str], stop: Sequence[str]) -> list[str]:
    """Feed the tokens of `pieces` (encoded apart, so that token boundaries fall between
    them) one at a time; return the emitted text after each token and after flush()."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    seen: list[str] = []
    for piece in pieces:
        for i in encode(tokenizer, piece):
            detok.add_tokens([i])
            seen.append(detok.text)
    detok.flush()
    seen.append(detok.text)
    return seen


def test_stop_string_cuts_exactly_before_it(tokenizer) -> None:
    ids = encode(tokenizer, "Hello world. STOP here and more text")
    deltas, detok = feed(tokenizer, ids, stop=["STOP"])
    assert "".join(deltas) == "Hello world. "
    assert detok.stopped
    assert detok.add_tokens(encode(tokenizer, " more")) == ""
    assert detok.text == "Hello world. "


def test_stop_string_spanning_tokens_never_leaks(tokenizer) -> None:
    text = "The answer is forty-two, obviously."
    ids = encode(tokenizer, text)
    assert not any("forty-two" in tokenizer.decode([i]) for i in ids)  # it spans tokens
    seen = stop_run(tokenizer, [text], ["forty-two"])
    assert seen[-1] == "The answer is "
    assert all("The answer is ".startswith(s) for s in seen)


def test_partial_match_that_fails_is_emitted_once_known(tokenizer) -> None:
    seen = stop_run(tokenizer, ["Let's ST", "ART now"], ["STOP"])
    n_first = len(encode(tokenizer, "Let's ST"))
    assert seen[n_first - 1] == "Let's "  # "ST" may still become "STOP": held
    assert seen[n_first] == "Let's START"  # "STA" cannot: out it goes
    assert seen[-1] == "Let's START now"


def test_held_prefix_is_released_by_flush(tokenizer) -> None:
    deltas, detok = feed(tokenizer, encode(tokenizer, "Wait for the ST"), stop=["STOP"])
    assert deltas[-1] == "ST"
    assert "".join(deltas) == "Wait for the ST"
    assert not detok.stopped


def test_stop_string_may_start_inside_held_text(tokenizer) -> None:
    # "S" held as a prefix of "STOP", then "STOP" completes after it: the cut is at the
    # second "S", and the first one (no longer a prefix) is emitted.
    seen = stop_run(tokenizer, ["x S", "STOP y"], ["STOP"])
    assert seen[-1] == "x S"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("alpha beta gamma", ["gamma", "beta"], "alpha "),  # earliest wins, whatever order
        ("alpha beta gamma", ["beta", "gamma"], "alpha "),
        ("see the ENDING now", ["ENDING", "END"], "see the "),  # one a prefix of the other
        ("see the ENDING now", ["END", "ENDING"], "see the "),
        ("see the ENDING now", ["ING", "ENDING"], "see the "),  # same end: starts first
        ("one xyz two", ["xyz", "y"], "one x"),  # "y" completes before "xyz"
        ("今日は🎉パーティー🎉です", ["🎉"], "今日は"),
        ("今日は🎉パーティー🎉です", ["ーティ"], "今日は🎉パ"),
        ("flags 🇯🇵🇺🇸 here", ["🇺🇸"], "flags 🇯🇵"),
        ("no stop in here", ["STOP", "END"], "no stop in here"),
    ],
)
def test_stop_strings_table(tokenizer, text: str, stop: list[str], expected: str) -> None:
    ids = encode(tokenizer, text)
    for sizes in (None, [len(ids)], random_sizes(len(ids), random.Random(0), largest=4)):
        deltas, detok = feed(tokenizer, ids, sizes, stop=stop)
        assert "".join(deltas) == expected
        assert detok.stopped == (expected != text)
        assert not any(FFFD in d for d in deltas)


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    ids = encode(tokenizer, "Hi") + [IM_END] + encode(tokenizer, " there 🎉") + [ENDOFTEXT]
    skipped, _ = feed(tokenizer, ids)
    kept, _ = feed(tokenizer, ids, skip_special_tokens=False)
    assert "".join(skipped) == tokenizer.decode(ids, skip_special_tokens=True) == "Hi there 🎉"
    assert "".join(kept) == tokenizer.decode(ids, skip_special_tokens=False)
    assert "".join(kept) == "Hi<|im_end|> there 🎉<|endoftext|>"


def test_special_token_text_as_stop_string(tokenizer) -> None:
    ids = encode(tokenizer, "Hi") + [IM_END] + encode(tokenizer, " there")
    kept, _ = feed(tokenizer, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    skipped, _ = feed(tokenizer, ids, stop=["<|im_end|>"])
    assert "".join(kept) == "Hi"
    assert "".join(skipped) == "Hi there"


PROPERTY = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPERTY
@given(
    text=st.text(max_size=60),
    seed=st.integers(0, 2**32 - 1),
    specials=st.lists(st.sampled_from([ENDOFTEXT, IM_START, IM_END]), max_size=3),
    skip=st.booleans(),
)
def test_property_random_text_random_chunks(
    tokenizer, text: str, seed: int, specials: list[int], skip: bool
) -> None:
    rng = random.Random(seed)
    ids = encode(tokenizer, text)
    for special in specials:
        ids.insert(rng.randint(0, len(ids)), special)
    decoded = tokenizer.decode(ids, skip_special_tokens=skip)
    deltas, _ = feed(tokenizer, ids, random_sizes(len(ids), rng), skip_special_tokens=skip)
    assert "".join(deltas) == decoded
    if FFFD not in decoded:
        assert not any(FFFD in d for d in deltas)


@PROPERTY
@given(data=st.data(), text=st.text(min_size=1, max_size=60), seed=st.integers(0, 2**32 - 1))
def test_property_stop_substring_cuts_at_first_occurrence(
    tokenizer, data: st.DataObject, text: str, seed: int
) -> None:
    ids = encode(tokenizer, text)
    decoded = decode(tokenizer, ids)
    assume(decoded)  # the tokenizer drops some control characters
    start = data.draw(st.integers(0, len(decoded) - 1))
    stop = decoded[start : data.draw(st.integers(start + 1, len(decoded)))]
    expected = decoded[: decoded.find(stop)]
    detok = IncrementalDetokenizer(tokenizer, [stop])
    for size in random_sizes(len(ids), random.Random(seed)):
        detok.add_tokens(ids[:size])
        ids = ids[size:]
        assert expected.startswith(detok.text)  # nothing past the cut, ever
    # A stop string with U+FFFD in it (bytes that never made a character) shows up in flush().
    assert detok.stopped or FFFD in stop
    assert detok.flush() == ""
    assert detok.stopped
    assert detok.text == expected


def first_stop_cut(text: str, stops: Sequence[str]) -> str:
    """Reference: the text up to the first stop string the model completed, then cut at the
    earliest stop string in that text."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    if not ends:
        return text
    head = text[: min(ends)]
    return text[: min(head.find(s) for s in stops if s in head)]


@PROPERTY
@given(
    data=st.data(),
    text=st.text(alphabet="abAB 🎉日", max_size=40),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_several_stops_match_reference(
    tokenizer, data: st.DataObject, text: str, seed: int
) -> None:
    stops = data.draw(st.lists(st.text(alphabet="abAB 🎉日", min_size=1, max_size=4), max_size=3))
    ids = encode(tokenizer, text)
    expected = first_stop_cut(decode(tokenizer, ids), stops)
    for sizes in (None, random_sizes(len(ids), random.Random(seed))):
        deltas, _ = feed(tokenizer, ids, sizes, stop=stops)
        assert "".join(deltas) == expected


def single_byte_tokens(tokenizer) -> list[int]:
    """The byte-level alphabet: one token per byte (those in the vocabulary)."""
    return sorted(i for tok, i in tokenizer.get_vocab().items() if len(tok) == 1 and i > 16)


@PROPERTY
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), skip=st.booleans())
def test_property_arbitrary_bytes_add_up_and_never_stall(
    tokenizer, data: st.DataObject, seed: int, skip: bool
) -> None:
    # Any byte sequence a model may produce, valid UTF-8 or not, with special tokens between.
    pool = [*single_byte_tokens(tokenizer), ENDOFTEXT, IM_END]
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=40))
    deltas, _ = feed(
        tokenizer, ids, random_sizes(len(ids), random.Random(seed), largest=3), (), skip
    )
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    if skip:  # a byte is at most one character: at most MAX_PENDING_TOKENS were pending
        assert len(deltas[-1]) <= MAX_PENDING_TOKENS
