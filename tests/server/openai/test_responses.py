"""The Responses API, spoken to by the official `openai` client (client.responses) over
HTTP on 127.0.0.1, with the real model behind it."""

import hashlib

import openai
import pytest

from app.config import CacheConfig, EngineConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.server.app import ServerConfig, create_app
from tests.e2e.live_server import live_server
from tests.server.openai.util import MODEL

GREEDY = {"temperature": 0, "max_output_tokens": 16}


def test_create_non_streaming_and_streaming_agree(client):
    full = client.responses.create(model=MODEL, input="Name a fruit.", **GREEDY)
    assert full.object == "response" and full.status in ("completed", "incomplete")
    assert full.output_text and full.output[0].type == "message"
    assert full.output[0].role == "assistant"
    u = full.usage
    assert u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens

    events = list(
        client.responses.create(model=MODEL, input="Name a fruit.", stream=True, **GREEDY)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text
    done = events[-1].response
    assert done.output_text == full.output_text
    assert done.usage.output_tokens == u.output_tokens


def test_instructions_and_message_items(client):
    items = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!"}]},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "What is my name?"}],
        },
    ]
    out = client.responses.create(instructions="Answer in one word.", input=items, **GREEDY)
    assert out.instructions == "Answer in one word." and out.output_text
    plain = client.responses.create(input="What is my name?", **GREEDY)
    assert out.usage.input_tokens > plain.usage.input_tokens  # the history went in


def test_max_output_tokens_makes_it_incomplete(client):
    out = client.responses.create(input="Tell me a long story.", temperature=0, max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3


def test_follow_up_reuses_the_pinned_conversation(client):
    first = client.responses.create(input="Name a colour.", **GREEDY)
    follow = client.responses.create(
        input="And another one?", previous_response_id=first.id, **GREEDY
    )
    assert follow.previous_response_id == first.id
    cached = follow.usage.input_tokens_details.cached_tokens
    # The whole first exchange (its prompt and reply) is reused: only the new turn is new.
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 2
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The follow-up of a follow-up reuses the longer conversation.
    third = client.responses.create(input="Thanks.", previous_response_id=follow.id, **GREEDY)
    assert third.usage.input_tokens_details.cached_tokens > cached


def test_retrieve_and_delete(client):
    out = client.responses.create(input="Say hi.", metadata={"k": "v"}, **GREEDY)
    got = client.responses.retrieve(out.id)
    assert got.id == out.id and got.output_text == out.output_text
    assert got.metadata == {"k": "v"}
    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="more", previous_response_id=out.id, **GREEDY)


def test_not_stored_is_not_kept(client):
    out = client.responses.create(input="Say hi.", store=False, **GREEDY)
    assert out.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)


def test_streamed_response_is_stored(client):
    events = list(client.responses.create(input="Say hi.", stream=True, **GREEDY))
    final = events[-1].response
    assert client.responses.retrieve(final.id).output_text == final.output_text


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"text": {"format": {"type": "yaml"}}}, "text"),
    ],
)
def test_unsupported_is_a_clear_400(client, kwargs, param):
    body = {"input": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    assert info.value.body["param"] == param, info.value.body


def test_unknown_field_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(input="hi", extra_body={"frobnicate": 1})
    assert info.value.body["param"] == "frobnicate"


def test_json_schema_text_format(client):
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string"}},
        "required": ["fruit"],
        "additionalProperties": False,
    }
    out = client.responses.create(
        input="Name a fruit as JSON.",
        text={"format": {"type": "json_schema", "name": "f", "schema": schema}},
        temperature=0,
        max_output_tokens=40,
    )
    import json

    assert set(json.loads(out.output_text)) == {"fruit"}


@pytest.fixture(scope="module")
def keyed(smollm):
    keys = {t: hashlib.sha256(f"key-{t}".encode()).digest() for t in ("a", "b")}
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(64 << 20)), smollm))
    with live_server(create_app(engine=engine, server_config=ServerConfig(api_keys=keys))) as s:
        yield s


def test_a_response_belongs_to_its_tenant(keyed):
    a, b = (
        openai.OpenAI(base_url=keyed.url + "/v1", api_key=f"key-{t}", max_retries=0)
        for t in ("a", "b")
    )
    out = a.responses.create(input="Say hi.", **GREEDY)
    assert a.responses.retrieve(out.id).id == out.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(input="more", previous_response_id=out.id, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(out.id)
    follow = a.responses.create(input="Again.", previous_response_id=out.id, **GREEDY)
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_input_items_list_the_requests_input(client):
    items = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada!"},
        {"role": "user", "content": [{"type": "input_text", "text": "My name?"}]},
    ]
    out = client.responses.create(input=items, **GREEDY)
    listed = client.responses.input_items.list(out.id, order="asc")
    assert [i.role for i in listed.data] == ["user", "assistant", "user"]
    assert listed.data[2].content[0].text == "My name?" and all(i.id for i in listed.data)
    newest = client.responses.input_items.list(out.id, limit=1)
    assert newest.data[0].id == listed.data[2].id and newest.has_more
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(out.id, limit=0)
