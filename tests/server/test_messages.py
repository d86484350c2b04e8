"""Anthropic's Messages API, spoken to by the official `anthropic` client, unchanged, over
HTTP on 127.0.0.1 with the real model behind it; the key goes as x-api-key, as that
client sends it."""

import anthropic
import pytest

from app.config import CacheConfig, EngineConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.server.app import ServerConfig, create_app
from tests.e2e.live_server import live_server
from tests.server.openai.util import MODEL

KEY = "messages-test-key"
# This client no longer has temperature among its arguments; older ones send it as a field.
GREEDY = {"max_tokens": 16, "extra_body": {"temperature": 0}}


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(smollm):
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(64 << 20)), smollm))
    with live_server(create_app(engine=engine, server_config=ServerConfig(api_key=KEY))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_create(client):
    out = client.messages.create(
        model=MODEL, system="Be brief.", messages=ask("Name a fruit."), **GREEDY
    )
    assert out.type == "message" and out.role == "assistant" and out.model == MODEL
    assert out.content[0].type == "text" and out.content[0].text
    assert out.stop_reason in ("end_turn", "max_tokens")
    assert out.usage.output_tokens > 0 and out.usage.input_tokens > 0


def test_streaming_matches_non_streaming(client):
    full = client.messages.create(model=MODEL, messages=ask("Name a fruit."), **GREEDY)
    with client.messages.stream(model=MODEL, messages=ask("Name a fruit."), **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert "content_block_delta" in kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_raw_stream_events(client):
    events = list(client.messages.create(model=MODEL, messages=ask("Hi"), stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert deltas and all(e.delta.type == "text_delta" for e in deltas)
    assert events[-2].type == "message_delta" and events[-2].delta.stop_reason


def test_max_tokens_and_stop_sequences(client):
    cut = client.messages.create(
        model=MODEL,
        messages=ask("Tell me a long story."),
        max_tokens=3,
        extra_body={"temperature": 0},
    )
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    counted = client.messages.create(
        model=MODEL,
        messages=ask("Count from 1 to 10, one per line."),
        max_tokens=60,
        extra_body={"temperature": 0},
    )
    assert "4" in counted.content[0].text  # the model counts past 4 when let be
    stopped = client.messages.create(
        model=MODEL,
        messages=ask("Count from 1 to 10, one per line."),
        max_tokens=60,
        stop_sequences=["4"],
        extra_body={"temperature": 0},
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "4"
    assert "4" not in stopped.content[0].text


def test_content_blocks_and_cache_reads(client):
    history = [
        {"role": "user", "content": [{"type": "text", "text": "My name is Ada."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello Ada!"}]},
    ]
    first = client.messages.create(
        model=MODEL, messages=history + ask("What is my name?"), **GREEDY
    )
    again = client.messages.create(
        model=MODEL, messages=history + ask("What is my name?"), **GREEDY
    )
    # The resent prompt is found in the prefix cache: input_tokens counts only the rest.
    assert again.usage.cache_read_input_tokens > 0
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    assert again.usage.input_tokens < total


def test_count_tokens(client):
    short = client.messages.count_tokens(model=MODEL, messages=ask("Hi"))
    longer = client.messages.count_tokens(model=MODEL, messages=ask("Hi"), system="Be brief. " * 30)
    assert 0 < short.input_tokens < longer.input_tokens
    out = client.messages.create(model=MODEL, messages=ask("Hi"), **GREEDY)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == short.input_tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"tools": [{"name": "f", "input_schema": {"type": "object"}}]},  # no tool template
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"max_tokens": 20_000},  # more than the context window
        {"extra_body": {"frobnicate": 1}},
        {"model": "claude-opus"},
    ],
)
def test_unsupported_is_a_clear_error(client, kwargs):
    body = {"model": MODEL, "messages": ask("Hi"), **GREEDY, **kwargs}
    with pytest.raises((anthropic.BadRequestError, anthropic.NotFoundError)) as info:
        client.messages.create(**body)
    assert info.value.body["type"] == "error" and info.value.body["error"]["message"]


def test_a_wrong_key_is_refused(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, messages=ask("Hi"), **GREEDY)
