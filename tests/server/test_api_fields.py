"""The Responses, Messages and tokenizer endpoints' fields: each honoured, ignored for a
stated reason, or refused naming it, and docs/api.md's tables in step with the code's
(a fake engine behind: fast)."""

import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from app.server.api_fields import COUNT_TOKENS_FIELDS, MESSAGES_FIELDS, RESPONSES_FIELDS
from app.server.app import create_app
from app.server.tokenizer_api import DETOKENIZE_FIELDS, TEMPLATE_FIELDS, TOKENIZE_FIELDS
from tests.server.fake_engine import FakeEngine
from tests.server.testclient import for_testclient

ASK = [{"role": "user", "content": "hi"}]
DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


@pytest.fixture
def client(tokenizer):
    fake = FakeEngine(tokenizer, reply="one two three")
    with TestClient(create_app(engine=fake, server_config=for_testclient())) as c:
        yield c


def respond(client, **body):
    return client.post("/v1/responses", json={"input": "hi", **body})


def message(client, **body):
    return client.post("/v1/messages", json={"max_tokens": 8, "messages": ASK, **body})


def _sections() -> dict[str, dict[str, str]]:
    text = DOC.read_text()
    out = {}
    for title in (
        "Responses request fields",
        "Messages request fields",
        "/tokenize fields",
        "/detokenize fields",
        "/apply-template fields",
    ):
        section = text[text.index(f"### {title}") :]
        section = section[: section.index("\n#", 4)] if "\n#" in section[4:] else section
        out[title] = dict(re.findall(r"^\| `(\w+)` \| (\w+)", section, flags=re.M))
    return out


def test_the_docs_tables_are_the_codes():
    docs = _sections()
    for title, table in [
        ("Responses request fields", RESPONSES_FIELDS),
        ("Messages request fields", MESSAGES_FIELDS),
        ("/tokenize fields", TOKENIZE_FIELDS),
        ("/detokenize fields", DETOKENIZE_FIELDS),
        ("/apply-template fields", TEMPLATE_FIELDS),
    ]:
        assert docs[title] == {k: f.handling for k, f in table.items()}, title
    assert set(COUNT_TOKENS_FIELDS) <= set(MESSAGES_FIELDS)


@pytest.mark.parametrize(
    "name", [k for k, f in RESPONSES_FIELDS.items() if f.handling == "refused"]
)
def test_responses_refuse_naming_the_field(client, name):
    r = respond(client, **{name: {"x": 1}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name
    assert respond(client).status_code == 200  # everything else keeps working


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"store": "yes"}, "store"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"background": True}, "background"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"input": 3}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"instructions": 5}, "instructions"),
        ({"previous_response_id": "resp_nope"}, "response_id"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema"}}}, "text"),
        ({"text": {"verbosity": "high"}}, "text"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"metadata": "tags"}, "metadata"),
        ({"model": "gpt-5"}, "model"),
    ],
)
def test_responses_bad_values_are_clear_errors(client, body, param):
    r = respond(client, **body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_responses_truncation_auto_drops_the_oldest_turns(client, tokenizer):
    turn = "word " * 300  # ~300 tokens a message: 8 of them outgrow the fake's 2048
    items = []
    for i in range(4):
        items += [
            {"role": "user", "content": f"{i} {turn}"},
            {"role": "assistant", "content": turn},
        ]
    items.append({"role": "user", "content": "last"})
    too_long = respond(client, input=items)
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    r = respond(client, input=items, truncation="auto", max_output_tokens=16)
    assert r.status_code == 200, r.text
    assert r.json()["truncation"] == "auto" and r.json()["usage"]["input_tokens"] < 2048


def test_responses_ignored_fields_pass_with_their_accepted_values(client):
    body = {
        "truncation": "disabled",
        "service_tier": "auto",
        "include": [],
        "background": False,
        "safety_identifier": "u",
        "stream_options": {"include_obfuscation": False},
        "user": "u",
        "prompt_cache_key": "k",
        "top_k": 5,
        "seed": 1,
    }
    assert respond(client, **body).status_code == 200


@pytest.mark.parametrize("name", [k for k, f in MESSAGES_FIELDS.items() if f.handling == "refused"])
def test_messages_refuse_naming_the_field(client, name):
    r = message(client, **{name: {"x": 1}})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and name in r.json()["error"]["message"]
    assert message(client).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": None},
        {"messages": []},
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]},
        {"system": 5},
        {"stop_sequences": "x"},
        {"stop_sequences": ["a"] * 17},
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},  # no reasoning control
        {"thinking": "on"},
        {"tool_choice": {"type": "any"}},  # without tools
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"service_tier": "priority"},
        {"metadata": "tags"},
        {"metadata": {"user_id": 5}},
        {"frobnicate": 1},
    ],
)
def test_messages_bad_values_are_clear_errors(client, body):
    r = message(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]


def test_messages_accepted_fields(client):
    body = {
        "metadata": {"user_id": "u"},
        "cache_control": {"type": "ephemeral"},
        "service_tier": "auto",
        "thinking": {"type": "disabled"},
        "top_k": 3,
        "system": [{"type": "text", "text": "Be brief."}],
    }
    r = message(client, **body)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == "one two three"


def test_anthropic_errors_have_anthropics_shape(client):
    r = message(client, model="claude-x")
    assert r.status_code == 404
    assert r.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": r.json()["error"]["message"]},
    }


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"input": "hi", "stream": True}),
        ("/v1/messages", {"max_tokens": 500, "messages": ASK, "stream": True}),
    ],
)
def test_a_client_that_leaves_a_stream_aborts_it(tokenizer, path, body):
    import time

    import httpx

    from tests.e2e.live_server import live_server

    fake = FakeEngine(tokenizer, delay=0.02, reply="word " * 400)
    with live_server(create_app(engine=fake)) as server:
        with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
            lines = r.iter_lines()
            for _ in range(12):
                next(lines)
        # The reply would take 8 s more; its engine stream is closed (aborted) at once.
        deadline = time.monotonic() + 3
        while fake.live and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not fake.live
