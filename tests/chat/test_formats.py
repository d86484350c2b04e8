"""Tool-call and reasoning formats: each family's replies parsed as they stream, the same
however the text is cut into deltas, with argument deltas that add up to the call."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.chat.formats import CallArgs, CallDone, CallStart, ChatFormat, Parsed, Reasoning, Text

HERMES = ChatFormat(tools="hermes")
LLAMA = ChatFormat(tools="llama3_json")
GEMMA = ChatFormat(tools="pythonic")
QWEN3 = ChatFormat(tools="hermes", reasoning=True)

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
REPLIES = [
    (HERMES, f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>", "Let me look.", ""),
    (HERMES, f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL}</tool_call>", "", ""),
    (HERMES, "No tools needed: 2 < 3 and <tool_ is not a tag.", None, ""),
    (LLAMA, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", ""),
    (LLAMA, '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "}"}}', "", ""),
    (LLAMA, "Plain text {not a call}", None, ""),
    (GEMMA, '[get_weather(city="Paris", days=2)]', "", ""),
    (GEMMA, '```tool_code\nget_weather(city="Paris")\n```', "", ""),
    (GEMMA, "Sunny in Paris.", None, ""),
    (
        QWEN3,
        f"<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>",
        "",
        "The user wants weather.",
    ),
    (QWEN3, "<think>Short.</think>Paris is sunny.", "Paris is sunny.", "Short."),
]


def feed(fmt: ChatFormat, pieces: list[str], mode: str | None = "auto"):
    stream = fmt.stream(mode)
    events = []
    for piece in pieces:
        events += stream.feed(piece)
    return events + stream.finish()


def check_calls(events):
    """Every call starts, gets deltas that add up to its arguments, and ends, in order."""
    started, args = {}, {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index not in started
            started[e.index] = e
            args[e.index] = ""
        elif isinstance(e, CallArgs):
            args[e.index] += e.text
        elif isinstance(e, CallDone):
            assert e.call.arguments == args[e.index] and e.call.name == started[e.index].name
            assert e.call.id == started[e.index].id
            json.loads(e.call.arguments)
    return started


@pytest.mark.parametrize(("fmt", "reply", "content", "reasoning"), REPLIES)
def test_a_reply_parses_the_same_whole_and_char_by_char(fmt, reply, content, reasoning):
    whole = fmt.parse(reply, "auto")
    chars = feed(fmt, list(reply))
    check_calls(chars)
    assert Parsed().add(chars).content == whole.content
    calls = [(c.name, c.arguments) for c in Parsed().add(chars).calls]
    assert calls == [(c.name, c.arguments) for c in whole.calls]
    assert whole.content == (reply if content is None else content)
    assert whole.reasoning == reasoning


def test_hermes_arguments_stream_before_the_call_ends():
    stream = HERMES.stream("auto")
    events = stream.feed('<tool_call>{"name": "f", "arguments": {"q": "long')
    assert [type(e) for e in events] == [CallStart, CallArgs]
    assert events[1].text == '{"q": "long'
    events = stream.feed(' text"}}</tool_call>')
    assert events[0] == CallArgs(0, ' text"}')
    assert isinstance(events[1], CallDone)
    assert json.loads(events[1].call.arguments) == {"q": "long text"}


def test_calls_parse_to_what_they_say():
    parsed = HERMES.parse(REPLIES[1][1], "auto")
    assert [c.name for c in parsed.calls] == ["get_weather", "get_weather"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris", "days": [1, 2]}
    llama = LLAMA.parse(REPLIES[4][1], "auto")
    assert [(c.name, json.loads(c.arguments)) for c in llama.calls] == [
        ("a", {}),
        ("b", {"x": "}"}),
    ]
    gemma = GEMMA.parse(REPLIES[6][1], "auto")
    assert json.loads(gemma.calls[0].arguments) == {"city": "Paris", "days": 2}


def test_forced_reply_is_one_json_call_for_every_family():
    for fmt in (HERMES, LLAMA, GEMMA, QWEN3):
        parsed = fmt.parse('{"name": "f", "arguments": {"a": 1}}', "forced")
        assert [c.name for c in parsed.calls] == ["f"] and parsed.content == ""


def test_parallel_false_keeps_the_first_call():
    stream = HERMES.stream("auto", parallel=False)
    events = stream.feed(REPLIES[1][1]) + stream.finish()
    assert [e.call.name for e in events if isinstance(e, CallDone)] == ["get_weather"]


def test_no_tools_leaves_the_text_alone_but_splits_reasoning():
    assert HERMES.parse(REPLIES[0][1]).content == REPLIES[0][1]
    parsed = QWEN3.parse("<think>hmm</think>Answer.")
    assert (parsed.reasoning, parsed.content) == ("hmm", "Answer.")


def test_a_template_that_opens_think_starts_inside_it():
    fmt = ChatFormat(reasoning=True, think_opened=True)
    events = feed(fmt, list("pondering</think>The answer."), None)
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "pondering"
    assert "".join(e.text for e in events if isinstance(e, Text)) == "The answer."


def test_a_call_cut_short_still_adds_up():
    events = feed(HERMES, ['<tool_call>{"name": "f", "arguments": {"a": "unfini'])
    check_calls([e for e in events if not isinstance(e, CallDone)])
    done = [e for e in events if isinstance(e, CallDone)]
    assert done and done[0].call.arguments == '{"a": "unfini'


def test_reasoning_effort_needs_a_template_that_offers_it():
    with pytest.raises(ValueError, match="no reasoning control"):
        HERMES.template_args("low")
    assert ChatFormat(effort_control="enable_thinking").template_args("none") == {
        "enable_thinking": False
    }
    assert ChatFormat(effort_control="reasoning_effort").template_args("high") == {
        "reasoning_effort": "high"
    }
    with pytest.raises(ValueError):
        ChatFormat(effort_control="reasoning_effort").template_args("extreme")


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(REPLIES), st.lists(st.integers(0, 200), max_size=8))
def test_any_cut_into_deltas_parses_the_same(case, cuts):
    fmt, reply, _, _ = case
    points = sorted({c % (len(reply) + 1) for c in cuts})
    pieces = [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)])]
    events = feed(fmt, pieces)
    check_calls(events)
    got, whole = Parsed().add(events), fmt.parse(reply, "auto")
    assert (got.content, got.reasoning) == (whole.content, whole.reasoning)
    assert [(c.name, c.arguments) for c in got.calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]


def test_family_is_read_off_the_template():
    class Tok:
        def __init__(self, template):
            self.chat_template = template

        def apply_chat_template(self, *a, **k):
            return "<|im_start|>assistant\n"

    assert ChatFormat.of(Tok("{{ tools }} <tool_call>")).tools == "hermes"
    assert ChatFormat.of(Tok("{{ tools }} <|python_tag|> ipython")).tools == "llama3_json"
    assert ChatFormat.of(Tok("{{ tools }} ```tool_code")).tools == "pythonic"
    assert ChatFormat.of(Tok("{{ messages }}")).tools is None
    qwen3 = ChatFormat.of(Tok("{{ tools }} <tool_call> <think> enable_thinking"))
    assert qwen3.reasoning and qwen3.effort_control == "enable_thinking"
