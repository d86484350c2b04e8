"""One client cannot take every socket or every turn: per-client shares, and an idle
timeout for sockets that carry no turn. A real server on 127.0.0.1 (fake engine); the
second client connects from another loopback address (127.0.0.2), or with another key."""

import asyncio
import contextlib
import json
import uuid

import httpx
import pytest
import websockets

from app.server.app import ServerConfig, create_app
from app.server.chat_service import ChatConfig
from app.server.security import parse_keys_file
from tests.e2e.live_server import live_server
from tests.server.fake_engine import FakeEngine
from tests.server.test_security import ws_url

OTHER = {"local_addr": ("127.0.0.2", 0)}  # another machine, as far as the server can tell


def chat(id, conversation="c", max_tokens=3):
    return json.dumps({"type": "chat", "id": id, "conversation_id": conversation,
                       "messages": [{"role": "user", "content": "hi"}],
                       "params": {"max_tokens": max_tokens}})  # fmt: skip


async def open_many(url, count, **connect):
    """Open `count` sockets; those the server kept, and how many were told busy."""
    kept, busy = [], 0
    for _ in range(count):
        ws = await websockets.connect(url, **connect)
        with contextlib.suppress(websockets.ConnectionClosed):  # a busy one may be gone
            await ws.send(json.dumps({"type": "ping"}))
        frame = json.loads(await ws.recv())  # a busy server says so first
        if frame["type"] == "pong":
            kept.append(ws)
            continue
        assert frame["code"] == "busy" and frame["retryable"], frame
        busy += 1
        await ws.close()
    return kept, busy


async def served(url, **connect):
    """One turn on a new socket: its terminal frame, or "busy" when the server said so
    and closed the socket (1013) before the turn could be sent."""
    async with websockets.connect(url, **connect) as ws:
        try:
            await ws.send(chat("t", uuid.uuid4().hex))  # each socket: a client of its own
            while (frame := json.loads(await ws.recv()))["type"] not in ("done", "error"):
                pass
            return frame
        except websockets.ConnectionClosed as closed:
            assert closed.rcvd is not None and closed.rcvd.code == 1013
            return {"type": "error", "code": "busy"}


@pytest.fixture(scope="module")
def server(tokenizer):
    with live_server(create_app(engine=FakeEngine(tokenizer))) as s:  # the defaults
        yield s


def test_300_sockets_from_one_client_leave_room_for_another(server):
    async def main():
        kept, busy = await open_many(ws_url(server), 300)
        try:
            assert len(kept) == ChatConfig().max_connections_per_client and busy == 300 - len(kept)
            frame = await served(ws_url(server), **OTHER)
            assert frame["type"] == "done", frame
            assert (await served(ws_url(server)))["code"] == "busy"  # its share is taken
        finally:
            for ws in kept:
                await ws.close()
        for _ in range(100):  # its share comes back as the server sees the sockets close
            if (frame := await served(ws_url(server)))["type"] == "done":
                break
            await asyncio.sleep(0.05)
        assert frame["type"] == "done", frame

    asyncio.run(main())


def test_a_tenant_holding_its_share_of_sockets_leaves_room_for_another(tokenizer, tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice alice-key\nbob bob-key\n")
    chat = ChatConfig(max_connections=8, max_connections_per_client=4)
    config = ServerConfig(api_keys=parse_keys_file(path), chat=chat)
    with live_server(create_app(engine=FakeEngine(tokenizer), server_config=config)) as s:
        alice = {"additional_headers": {"Authorization": "Bearer alice-key"}}
        bob = {"additional_headers": {"Authorization": "Bearer bob-key"}}

        async def main():
            kept, busy = await open_many(ws_url(s), 10, **alice)
            try:
                assert len(kept) == 4 and busy == 6
                assert (await served(ws_url(s), **bob))["type"] == "done"
            finally:
                for ws in kept:
                    await ws.close()

        asyncio.run(main())


def test_turns_are_shared_per_client_across_sockets_and_v1(tokenizer):
    fake = FakeEngine(tokenizer, delay=0.5)  # turns that last a while
    config = ServerConfig(chat=ChatConfig(max_turns_per_client=4))
    with live_server(create_app(engine=fake, server_config=config)) as s:

        async def main():
            sockets = [await websockets.connect(ws_url(s)) for _ in range(2)]
            for i in range(4):  # two turns on each socket: the client's share
                await sockets[i % 2].send(chat(f"t{i}", f"c{i}", max_tokens=40))
            for ws in sockets:
                started = 0
                while started < 2:
                    frame = json.loads(await ws.recv())
                    assert frame["type"] in ("start", "token"), frame
                    started += frame["type"] == "start"
            await sockets[0].send(chat("extra", "cx"))
            while (frame := json.loads(await sockets[0].recv()))["id"] != "extra":
                pass
            assert frame["type"] == "error" and frame["code"] == "too_many_turns"
            assert frame["retryable"] and "per client" in frame["message"]
            async with httpx.AsyncClient() as client:
                body = {"prompt": "hi", "max_tokens": 2}
                r = await client.post(s.url + "/v1/completions", json=body)
                assert r.status_code == 429 and r.headers["retry-after"]
                assert r.json()["error"]["type"] == "rate_limit_error"
            # Another client is served on both APIs meanwhile.
            assert (await served(ws_url(s), **OTHER))["type"] == "done"
            transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
            async with httpx.AsyncClient(transport=transport) as client:
                r = await client.post(s.url + "/v1/completions", json=body)
                assert r.status_code == 200
            for ws in sockets:
                await ws.close()

        asyncio.run(main())


def test_a_socket_that_carries_no_turn_is_closed_when_idle(tokenizer):
    fake = FakeEngine(tokenizer, delay=0.2)
    config = ServerConfig(chat=ChatConfig(idle_timeout_s=1.0))
    with live_server(create_app(engine=fake, server_config=config)) as s:

        async def keep_pinging(ws):
            while True:
                await ws.send(json.dumps({"type": "ping"}))
                assert json.loads(await ws.recv())["type"] == "pong"
                await asyncio.sleep(0.3)

        async def main():
            quiet = await websockets.connect(ws_url(s))
            busy = await websockets.connect(ws_url(s))
            talking = await websockets.connect(ws_url(s))
            pings = asyncio.create_task(keep_pinging(talking))
            await busy.send(chat("long", "c1", max_tokens=15))  # 3 s of tokens at least
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(quiet.recv(), 10)
            assert closed.value.rcvd.code == 1000 and "idle" in closed.value.rcvd.reason
            frames = [json.loads(await asyncio.wait_for(busy.recv(), 10))]
            while frames[-1]["type"] not in ("done", "error"):
                frames.append(json.loads(await asyncio.wait_for(busy.recv(), 10)))
            assert frames[-1]["type"] == "done"  # a turn in flight keeps its socket open
            with pytest.raises(websockets.ConnectionClosed):  # then it is idle too
                await asyncio.wait_for(busy.recv(), 10)
            assert not pings.done()  # a socket that keeps talking stays
            pings.cancel()
            await talking.close()

        asyncio.run(main())


def test_a_turn_ended_twice_gives_its_share_back_once(tokenizer):
    from app.server import protocol as p
    from app.server.chat_service import ChatService
    from app.server.security import Principal

    chat = ChatService(FakeEngine(tokenizer), ChatConfig(max_turns_per_client=2))
    me, journal = Principal("", "client:me", share="address:1"), Principal("", "client:me")

    def frame(conversation):
        text = (
            f'{{"type": "chat", "id": "t", "conversation_id": "{conversation}", '
            f'"messages": [{{"role": "user", "content": "hi"}}]}}'
        )
        return p.parse_frame(text, 100)

    first, _ = chat.begin_turn(frame("a"), me), chat.begin_turn(frame("b"), me)
    with pytest.raises(p.ProtocolError) as full:
        chat.begin_turn(frame("c"), me)
    assert full.value.code == p.TOO_MANY_TURNS and full.value.retryable
    chat.begin_turn(frame("d"), journal)  # a turn taken from the journal is nobody's share
    chat.end_turn(first, None, None)
    chat.end_turn(first, None, None)  # a late second end
    assert chat.turns.held("address:1") == 1
    chat.begin_turn(frame("c"), me)
    with pytest.raises(p.ProtocolError):
        chat.begin_turn(frame("e"), me)
