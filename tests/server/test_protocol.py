"""The /ws protocol parser alone: valid frames become the right dataclasses, and nothing
a client can send makes it fail other than with a ProtocolError."""

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.chat.prompt import Message
from app.server import protocol


def test_a_chat_frame_with_messages():
    frame = protocol.parse_frame(
        json.dumps({"type": "chat", "id": "t1", "conversation_id": "c", "system": "Be brief.",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "params": {"temperature": 0, "max_tokens": 7, "stop": "x"}}),
        max_tokens_limit=100,
    )  # fmt: skip
    assert isinstance(frame, protocol.ChatFrame)
    assert frame.messages == [Message("user", "Hi")] and frame.content is None
    assert frame.system == "Be brief." and frame.cache is True
    assert frame.params.temperature == 0 and frame.params.max_tokens == 7
    assert frame.params.stop == ("x",)


def test_defaults_are_the_engine_defaults():
    frame = protocol.parse_frame(
        '{"type": "chat", "id": "t", "conversation_id": "c", "content": "hi"}', 100
    )
    assert frame.params.max_tokens is None  # up to the context window, as on /v1


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        ('{"type": "cancel", "id": "t"}', protocol.CancelFrame),
        ('{"type": "delete", "conversation_id": "c"}', protocol.DeleteFrame),
        ('{"type": "ping"}', protocol.PingFrame),
    ],
)
def test_small_frames(raw, kind):
    assert isinstance(protocol.parse_frame(raw, 100), kind)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -1}, "params.temperature"),
        ({"max_tokens": 101}, "params.max_tokens is limited to 100"),
        ({"seed": "x"}, "params.seed must be an integer"),
        ({"stop": [1]}, "params.stop"),
        ({"bogus": 1}, "unknown params: bogus"),
    ],
)
def test_bad_params_name_the_field(params, message):
    raw = json.dumps({"type": "chat", "id": "t", "conversation_id": "c", "content": "hi",
                      "params": params})  # fmt: skip
    with pytest.raises(protocol.ProtocolError) as err:
        protocol.parse_frame(raw, 100)
    assert err.value.code == protocol.BAD_REQUEST and message in err.value.message
    assert err.value.id == "t"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=20,
)  # fmt: skip
frame_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["chat", "cancel", "delete", "ping", "x"])},
    optional={
        "id": json_values,
        "conversation_id": json_values,
        "messages": json_values,
        "content": json_values,
        "params": st.dictionaries(
            st.sampled_from(
                [
                    "temperature",
                    "top_p",
                    "top_k",
                    "max_tokens",
                    "seed",
                    "stop",
                    "min_p",
                    "ignore_eos",
                    "bogus",
                ]
            ),
            json_values,
            max_size=4,
        ),
        "system": json_values,
        "cache": json_values,
    },
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(json_values, frame_like))
def test_parser_never_fails_other_than_with_a_protocol_error(value):
    try:
        frame = protocol.parse_frame(json.dumps(value), max_tokens_limit=1000)
    except protocol.ProtocolError as err:
        assert err.code and err.message
    else:
        assert isinstance(frame, protocol.Frame)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_parser_takes_any_bytes_or_text(raw):
    with contextlib.suppress(protocol.ProtocolError):
        protocol.parse_frame(raw, max_tokens_limit=1000)


def chat_frame(**fields):
    return json.dumps({"type": "chat", "id": "t", "conversation_id": "c", **fields})


def test_continue_and_truncation():
    cut = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two"}]
    frame = protocol.parse_frame(chat_frame(messages=cut, **{"continue": True}), 100)
    assert frame.continue_final is True and frame.messages[-1].role == "assistant"
    plain = protocol.parse_frame(chat_frame(content="hi"), 100)
    assert plain.continue_final is False and plain.truncate is True  # /ws drops by default
    off = protocol.parse_frame(chat_frame(content="hi", truncation="disabled"), 100)
    assert off.truncate is False
    for bad in (
        chat_frame(messages=cut),  # a reply last, without continue
        chat_frame(messages=cut[:1], **{"continue": True}),  # nothing to continue
        chat_frame(content="hi", **{"continue": True}),
        chat_frame(content="hi", **{"continue": "yes"}),
        chat_frame(content="hi", truncation="sometimes"),
    ):
        with pytest.raises(protocol.ProtocolError) as err:
            protocol.parse_frame(bad, 100)
        assert err.value.code == protocol.BAD_REQUEST and err.value.id == "t"


def test_start_and_token_frames_carry_the_new_counts():
    start = json.loads(protocol.start_frame("t", "c", 10, 4, 0, dropped_messages=6))
    assert start["dropped_messages"] == 6
    assert json.loads(protocol.token_frame("t", 0, "a", 3))["completion_tokens"] == 3
    assert "completion_tokens" not in json.loads(protocol.token_frame("t", 0, "a"))
