"""Every kind of bad input, on /ws and on /v1: a clear error, and everything else keeps
working (a normal chat on another connection completes; the block pool is consistent), and
/health answers all along (nothing a request sends holds the event loop)."""

import asyncio
import json
import uuid

import httpx
import pytest
import websockets

from app.engine.async_engine import AsyncEngine
from app.server import protocol
from app.server.app import create_app
from tests.e2e.live_server import live_server
from tests.server.health_watch import health_watch
from tests.tiny import tiny_engine

LONG = "word " * 3000  # over the tiny model's 2,048-token context
HUGE_INT = "1" * 5000  # Python's int() refuses over 4,300 digits
HI = '[{"role": "user", "content": "hi"}]'


def raw_chat(tail: str) -> str:
    """A chat frame as text (for what json.dumps will not write): `tail` ends it."""
    return '{"type": "chat", "id": "bad", "conversation_id": "raw", ' + tail


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}, "required": ["a"]}
    return value


def chat(**fields):
    # A fresh conversation each time: a conversation belongs to the connection (no cookie
    # jar here) that started it, and these cases open many connections.
    frame = {"type": "chat", "id": "bad", "conversation_id": uuid.uuid4().hex, "content": "hi"}
    frame.update(fields)
    if isinstance(frame["content"], str) and "messages" not in frame:
        # A new conversation gives its history: `content` continues one the server holds.
        frame["messages"] = [{"role": "user", "content": frame.pop("content")}]
    return json.dumps({k: v for k, v in frame.items() if v is not ...})


WS_CASES = {
    "malformed JSON": ("{oops", "bad_request"),
    "binary frame": (b"\x00\x01\x02", "bad_request"),
    "unknown type": ('{"type": "teleport"}', "unknown_type"),
    "missing id": (chat(id=...), "bad_request"),
    "wrongly typed conversation_id": (chat(conversation_id=5), "bad_request"),
    "empty message list": (chat(content=..., messages=[]), "bad_request"),
    "unknown role": (
        chat(content=..., messages=[{"role": "root", "content": "x"}]),
        "bad_request",
    ),
    "content not a string": (chat(content={"text": "hi"}), "bad_request"),
    "frame over the limit": (chat(content="x" * (protocol.MAX_FRAME_BYTES + 1)), "too_large"),
    "history over the context": (chat(content=LONG), "context_length_exceeded"),
    "max_tokens < 1": (chat(params={"max_tokens": 0}), "bad_request"),
    "max_tokens over the limit": (chat(params={"max_tokens": 10**6}), "bad_request"),
    "temperature < 0": (chat(params={"temperature": -0.5}), "bad_request"),
    "top_p 0": (chat(params={"top_p": 0}), "bad_request"),
    "top_p > 1": (chat(params={"top_p": 1.5}), "bad_request"),
    "top_k < 0": (chat(params={"top_k": -1}), "bad_request"),
    "non-integer seed": (chat(params={"seed": 1.5}), "bad_request"),
    "string seed": (chat(params={"seed": "abc"}), "bad_request"),
    "stop list too long": (chat(params={"stop": [f"s{i}" for i in range(17)]}), "bad_request"),
    "unknown param": (chat(params={"temprature": 1}), "bad_request"),
    "cancel of an unknown id": ('{"type": "cancel", "id": "ghost"}', "unknown_id"),
    "integer over 4,300 digits": (
        raw_chat(f'"messages": {HI}, "params": {{"seed": {HUGE_INT}}}}}'),
        "bad_request",
    ),
    "lone surrogate in content": (
        raw_chat('"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        "bad_request",
    ),
    "lone low surrogate in a key": (raw_chat(f'"messages": {HI}, "\\udc00": 1}}'), "bad_request"),
    "lone surrogate in a cancel id": ('{"type": "cancel", "id": "\\ud800"}', "bad_request"),
    "100,000 empty messages": (
        chat(content=..., messages=[{"role": "user", "content": ""}] * 100_000),
        "too_large",
    ),
}

API_CASES = {
    "malformed JSON": (b"{oops", 400, None),
    "not an object": (b"[1, 2]", 400, None),
    "invalid UTF-8": (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    "missing messages": ({"messages": None}, 400, "messages"),
    "empty message list": ({"messages": []}, 400, "messages"),
    "unknown role": ({"messages": [{"role": "root", "content": "x"}]}, 400, "messages"),
    "content not a string": ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    "history over the context": (
        {"messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
    ),
    "max_tokens < 1": ({"max_tokens": 0}, 400, "max_tokens"),
    "max_tokens over the limit": ({"max_tokens": 10**6}, 400, "max_tokens"),
    "temperature < 0": ({"temperature": -1}, 400, "temperature"),
    "top_p 0": ({"top_p": 0}, 400, "top_p"),
    "top_p > 1": ({"top_p": 1.5}, 400, "top_p"),
    "top_k < 0": ({"top_k": -1}, 400, "top_k"),
    "non-integer seed": ({"seed": 1.5}, 400, "seed"),
    "stop list too long": ({"stop": [f"s{i}" for i in range(17)]}, 400, None),
    "n over the limit": ({"n": 129}, 400, "n"),
    "unknown model": ({"model": "gpt-17"}, 404, "model"),
    "body over the limit": (b"{" + b" " * (5 << 20) + b"}", 413, None),
    "integer over 4,300 digits": (f'{{"messages": {HI}, "seed": {HUGE_INT}}}'.encode(), 400, None),
    "lone surrogate in content": (
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        None,
    ),
    "lone surrogate in a key": (f'{{"messages": {HI}, "\\udfff": 1}}'.encode(), 400, None),
    "100,000 empty messages": (
        {"messages": [{"role": "user", "content": ""}] * 100_000},
        400,
        "messages",
    ),
    "20,000-value enum schema": (
        {"response_format": schema_format({"enum": [f"value-{i}" for i in range(20_000)]})},
        400,
        "response_format",
    ),
    "schema nested 400 deep": (
        {"response_format": schema_format(nested(400))},
        400,
        "response_format",
    ),
}


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = AsyncEngine(tiny_engine(tokenizer, num_blocks=1024))
    with live_server(create_app(engine=engine)) as s:
        s.engine = engine
        yield s


def ws_url(server):
    return server.url.replace("http", "ws") + "/ws"


async def normal_chat(url, conversation=None):
    conversation = conversation or uuid.uuid4().hex
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(chat(id="ok", conversation_id=conversation, content="Hello there",
                           params={"max_tokens": 5}))  # fmt: skip
        while (f := json.loads(await ws.recv()))["type"] not in ("done", "error"):
            pass
        return f


def assert_still_healthy(server):
    assert asyncio.run(normal_chat(ws_url(server)))["type"] == "done"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200
    server.engine.engine.check_integrity()  # idle now: a consistent pool


@pytest.mark.parametrize("case", list(WS_CASES))
def test_ws_bad_input(server, case):
    frame, code = WS_CASES[case]
    with health_watch(server.url) as health:
        ws_case(server, frame, code)
    assert not health.failures and health.answered
    assert_still_healthy(server)


def ws_case(server, frame, code):
    async def main():
        async with websockets.connect(ws_url(server), max_size=None) as ws:
            await ws.send(frame)
            err = json.loads(await ws.recv())
            assert err["type"] == "error" and err["code"] == code and err["message"]
            if code == "context_length_exceeded":
                assert "2048" in err["message"] and "tokens long" in err["message"]
            # The same connection still works.
            await ws.send(chat(id="again", content="Hi", params={"max_tokens": 3}))
            while (f := json.loads(await ws.recv()))["type"] not in ("done", "error"):
                pass
            assert f["type"] == "done"

    asyncio.run(main())


def test_ws_invalid_utf8_closes_only_that_connection(server):
    async def main():
        async with websockets.connect(ws_url(server)) as ws:
            await ws.send(b'{"type": "ping", "x": "\xff"}', text=True)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is None or closed.value.rcvd.code == 1007

    asyncio.run(main())
    assert_still_healthy(server)


def test_ws_duplicate_id_and_too_many_turns(server):
    async def main():
        async with websockets.connect(ws_url(server)) as ws:
            long = {"max_tokens": 1500, "ignore_eos": True}
            for i in range(8):
                await ws.send(chat(id=f"t{i}", conversation_id=f"c{i}", params=long))
            await ws.send(chat(id="t0", conversation_id="other", params=long))
            await ws.send(chat(id="t9", conversation_id="c9", params=long))
            errors = {}
            while len(errors) < 2:
                f = json.loads(await ws.recv())
                if f["type"] == "error":
                    errors[f["id"]] = f["code"]
            assert errors == {"t0": "duplicate_id", "t9": "too_many_turns"}

    asyncio.run(main())
    assert_still_healthy(server)


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_bad_input(server, case):
    body, status, param = API_CASES[case]
    with health_watch(server.url) as health:
        r = api_case(server, body)
    assert not health.failures and health.answered
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"] == param
    if case == "history over the context":
        assert error["code"] == "context_length_exceeded" and "2048" in error["message"]
    assert_still_healthy(server)


def api_case(server, body):
    if isinstance(body, dict):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    else:
        r = httpx.post(server.url + "/v1/chat/completions", content=body,
                       headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
    return r
