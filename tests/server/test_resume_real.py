"""A disconnect storm against a live server with the real model: 50 sockets cut mid-reply
(the TCP connection dropped, no close handshake), each turn resumed on a new socket.
0 lost turns, every reply whole and in order, 0 blocks left held."""

import asyncio
import json

import httpx
import websockets

from app.config import CacheConfig, EngineConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.server.app import create_app
from tests.e2e.live_server import browser_cookie, live_server
from tests.server.test_ws_real import wait_all_free

TURNS = 50
MAX_TOKENS = 24


async def storm(url: str, headers: dict) -> dict[int, list[dict]]:
    async def user(i: int) -> list[dict]:
        conversation = f"storm-{i}"
        frame = {
            "type": "chat",
            "id": "t",
            "conversation_id": conversation,
            "messages": [{"role": "user", "content": f"Say something about {i}."}],
            "params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
        }
        frames: list[dict] = []
        ws = await websockets.connect(url, additional_headers=headers)
        await ws.send(json.dumps(frame))
        while len([f for f in frames if f["type"] == "token"]) < 1 + i % 5:
            frames.append(json.loads(await ws.recv()))
        ws.transport.abort()  # the network is gone: no close frame, no FIN handshake
        last = max((f["seq"] for f in frames if f["type"] == "token"), default=-1)
        async with websockets.connect(url, additional_headers=headers) as ws:
            again = {"type": "resume", "id": "t", "conversation_id": conversation}
            again["after_seq"] = last
            await ws.send(json.dumps(again))
            while True:
                f = json.loads(await ws.recv())
                frames.append(f)
                if f["type"] in ("done", "error"):
                    break
            await ws.send(json.dumps({"type": "delete", "conversation_id": conversation}))
            while json.loads(await ws.recv())["type"] != "deleted":
                pass
        return frames

    results = await asyncio.gather(*(user(i) for i in range(TURNS)))
    return dict(enumerate(results))


def test_a_storm_of_cut_connections_loses_no_turn_and_no_block(smollm):
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(128 << 20)), smollm))
    with live_server(create_app(engine=engine)) as server:
        headers = browser_cookie(server.url)  # one browser: its sockets are one client
        url = server.url.replace("http://", "ws://") + "/ws"
        results = asyncio.run(asyncio.wait_for(storm(url, headers), 600))
        for frames in results.values():
            tokens = [f for f in frames if f["type"] == "token"]
            assert [f["seq"] for f in tokens] == list(range(len(tokens)))  # no gap, no dup
            terminal = [f for f in frames if f["type"] in ("done", "error")]
            assert len(terminal) == 1 and terminal[0]["type"] == "done"
            assert terminal[0]["usage"]["completion_tokens"] == MAX_TOKENS
        assert wait_all_free(engine.engine, timeout=10)  # every conversation deleted
        metrics = httpx.get(server.url + "/metrics").text
        assert f"parley:turn_resumes_total {TURNS}.0" in metrics
        assert "parley:num_requests_running 0.0" in metrics
    engine.engine.check_integrity()
