"""Many sockets closing at random, and a flood past the queue bound (tiny model, live
server on 127.0.0.1)."""

import asyncio
import json
import random
import time

import httpx
import pytest
import websockets

from app.engine.async_engine import AsyncEngine
from app.server.app import create_app
from tests.e2e.live_server import browser_cookie, live_server
from tests.engine.util import all_free
from tests.server.fake_engine import FakeEngine
from tests.tiny import tiny_engine


def chat(id, conversation, max_tokens=400):
    return json.dumps({"type": "chat", "id": id, "conversation_id": conversation,
                       "messages": [{"role": "user", "content": "Tell me a story."}],
                       "params": {"max_tokens": max_tokens, "ignore_eos": True}})  # fmt: skip


def test_fifty_sockets_closed_at_random_leave_a_clean_pool(tokenizer):
    engine = AsyncEngine(tiny_engine(tokenizer, num_blocks=4096, max_num_seqs=64))
    with live_server(create_app(engine=engine)) as s:
        url = s.url.replace("http", "ws") + "/ws"
        rng = random.Random(7)
        user = browser_cookie(s.url)  # one user, many sockets: the conversations are theirs

        async def one(i):
            async with websockets.connect(url, additional_headers=user) as ws:
                await ws.send(chat("t", f"conv{i}"))
                await asyncio.sleep(rng.uniform(0, 0.8))
                # ...and the socket closes mid-reply (or before the reply started).

        async def main():
            await asyncio.gather(*(one(i) for i in range(50)))
            async with websockets.connect(url, additional_headers=user) as ws:  # who deletes
                for i in range(50):
                    await ws.send(json.dumps({"type": "delete", "conversation_id": f"conv{i}"}))
                    assert json.loads(await ws.recv())["type"] == "deleted"

        asyncio.run(main())
        deadline = time.monotonic() + 20
        while not (all_free(engine.engine) and not engine.engine.requests):
            assert time.monotonic() < deadline, "blocks still held"
            time.sleep(0.05)
        assert httpx.get(s.url + "/ready").status_code == 200
        engine.engine.check_integrity()


def test_a_flood_past_the_queue_gets_busy_at_once_and_the_rest_finish(tokenizer):
    engine = AsyncEngine(tiny_engine(tokenizer, max_num_seqs=4, max_waiting=4))
    with live_server(create_app(engine=engine)) as s:

        async def request(client, i):
            start = time.monotonic()
            r = await client.post(s.url + "/v1/completions", json={
                "prompt": f"Story number {i}", "max_tokens": 60, "ignore_eos": True})  # fmt: skip
            return r.status_code, time.monotonic() - start, r

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(request(client, i) for i in range(40)))

        results = asyncio.run(main())
        ok = [t for code, t, _ in results if code == 200]
        busy = [(t, r) for code, t, r in results if code == 429]
        assert len(ok) + len(busy) == 40 and len(ok) >= 8 and busy
        assert all(r.headers["retry-after"] for _, r in busy)
        assert all(r.json()["error"]["type"] == "rate_limit_error" for _, r in busy)
        assert max(t for t, _ in busy) < max(ok)  # refused at once, not after waiting
        assert httpx.get(s.url + "/ready").status_code == 200

        async def ws_flood():
            url = s.url.replace("http", "ws") + "/ws"
            async with websockets.connect(url) as a, websockets.connect(url) as b:
                for i in range(8):  # long turns on one socket: a full batch, a full queue
                    await b.send(chat(f"t{i}", f"c{i}", 1500))
                started = 0
                while started < 4:  # the batch is running (max_num_seqs=4)
                    started += json.loads(await b.recv())["type"] == "start"
                await a.send(chat("extra", "cx", 5))
                while (f := json.loads(await a.recv()))["id"] != "extra":
                    pass
                return f

        frame = asyncio.run(ws_flood())
        assert frame["type"] == "error" and frame["code"] == "busy" and frame["retryable"]


def test_a_dead_engine_loop_makes_the_server_not_ready(tokenizer):
    engine = AsyncEngine(tiny_engine(tokenizer))
    with live_server(create_app(engine=engine)) as s:
        assert httpx.get(s.url + "/ready").status_code == 200

        def broken():
            raise RuntimeError("the loop itself breaks")

        engine._drain_inbox = broken
        engine._wake.set()
        deadline = time.monotonic() + 10
        while engine.healthy():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert httpx.get(s.url + "/ready").status_code == 503
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert httpx.get(s.url + "/health").status_code == 200  # the process is still up


@pytest.mark.parametrize("stream", [False, True])
def test_a_v1_client_that_leaves_before_the_first_token_aborts_its_request(tokenizer, stream):
    """Watched from acceptance: while the request waits for its first token (queued or
    prefilling), a client that goes away takes its request with it."""
    fake = FakeEngine(tokenizer, delay=60.0)  # the first token would come in a minute
    with live_server(create_app(engine=fake)) as s:
        body = {"prompt": "Hello", "max_tokens": 5, "stream": stream}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(s.url + "/v1/completions", json=body, timeout=0.5)
        assert len(fake.prompts) == 1
        deadline = time.monotonic() + 10
        while fake.live:
            assert time.monotonic() < deadline, "the request outlived its client"
            time.sleep(0.02)
