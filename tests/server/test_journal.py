"""The turn journal on a real redis-server, with the real model: turns that survive a
restart of the app, takeover of a silent process's turns, Redis faults and trimming."""

import asyncio
import logging
import re
from dataclasses import replace

import pytest
import redis
from starlette.testclient import TestClient

from app.chat.prompt import Message
from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.engine.request import SamplingParams
from app.server.app import ServerConfig, create_app
from app.server.journal import GROUP, Journal, JournalConfig
from app.server.journal_records import TurnRecord
from tests.redis_server import RedisServer, free_port
from tests.server.test_streams import first_tokens, resume, tokens, wait_for
from tests.server.test_ws_fake import text_of, until_terminal
from tests.server.testclient import for_testclient

PARAMS = {"temperature": 0, "max_tokens": 60, "ignore_eos": True}


# A recovered turn replays its recorded tokens (app.engine.continuation.REPLAY_MAX_TOKENS): this
# one turn goes on to the token on the default format. Past that bound it recomputes them
# in one prefill, exact in fp32 only: that path runs the fp32 reference.
DEFAULT = ModelConfig()
EXACT = ModelConfig(quantization="none", dtype="float32")


@pytest.fixture(params=["replay", "prefill"])
def model(request, monkeypatch):
    """How a recovered turn takes up its output, and the format where that is exact."""
    if request.param == "prefill":
        monkeypatch.setattr("app.engine.continuation.REPLAY_MAX_TOKENS", 0)
        return EXACT
    return DEFAULT


def engine(smollm, model=DEFAULT):
    return AsyncEngine(LLMEngine(EngineConfig(model, CacheConfig(64 << 20)), smollm))


def app(smollm, url, consumer="a", model=DEFAULT, **journal):
    # One cookie secret for every app: a browser stays the same client across a restart.
    journal_config = JournalConfig(url, consumer=consumer, **journal)
    config = ServerConfig(journal=journal_config, secret=b"k" * 32)
    return TestClient(
        create_app(engine=engine(smollm, model), server_config=for_testclient(config))
    )


def ask(id, conversation="c1", text="Tell me a story about a lighthouse.", **params):
    messages = [{"role": "user", "content": text}]
    return {"type": "chat", "id": id, "conversation_id": conversation, "messages": messages,
            "params": {**PARAMS, **params}}  # fmt: skip


def uninterrupted(smollm, frame, model=DEFAULT):
    """The reply the turn gets from a server that never stops (no journal)."""
    with TestClient(
        create_app(engine=engine(smollm, model), server_config=for_testclient())
    ) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            ws.send_json(frame)
            return text_of(until_terminal(ws, [frame["id"]])[frame["id"]])


def entries(url):
    r = redis.Redis.from_url(url)
    return r.xlen("parley:turns"), r.xpending("parley:turns", GROUP)["pending"]


def restart_mid_reply(smollm, url, frame, seen=4, model=DEFAULT):
    """Start a turn, drop the socket after `seen` tokens, stop the app (a deploy), start
    another app on the same journal and resume: every frame, in seq order."""
    cookie = None
    with app(smollm, url, model=model) as first:
        first.get("/")
        cookie = dict(first.cookies)
        with first.websocket_connect("/ws") as ws:
            ws.send_json(frame)
            before = tokens(first_tokens(ws, seen))
    assert entries(url)[1] == 1  # still pending: the next process takes it up
    with app(smollm, url, model=model) as second:
        second.cookies.update(cookie)  # the same browser
        with second.websocket_connect("/ws") as ws:
            ws.send_json(resume(frame["id"], frame["conversation_id"], before[-1]["seq"]))
            after = until_terminal(ws, [frame["id"]])[frame["id"]]
        metrics = second.get("/metrics").text
    assert "parley:journal_recovered_turns_total 1.0" in metrics
    return before, after


def test_a_journaled_turn_is_recorded_acknowledged_and_kept_a_while(smollm, redis_server):
    with app(smollm, redis_server.url) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            ws.send_json(ask("t1", max_tokens=12))
            frames = until_terminal(ws, ["t1"])["t1"]
        metrics = client.get("/metrics").text
    assert frames[-1]["type"] == "done"
    assert entries(redis_server.url) == (1, 0)  # appended, then acknowledged
    r = redis.Redis.from_url(redis_server.url)
    (key,) = r.keys("parley:rec:*")
    items = r.lrange(key, 0, -1)
    assert TurnRecord.from_json(items[0]).turn_id == "t1"
    assert b'"end"' in items[-1] and 0 < r.ttl(key) <= 600
    assert len(items) == 2 + len(tokens(frames))  # header, one item per frame, end
    assert "parley:journal_up 1.0" in metrics
    assert f"parley:journal_frames_total {len(tokens(frames))}.0" in metrics


def test_a_turn_survives_a_restart_of_the_app(smollm, redis_server, model):
    frame = ask("t1")
    before, after = restart_mid_reply(smollm, redis_server.url, frame, model=model)
    frames = before + tokens(after)
    assert [f["seq"] for f in frames] == list(range(len(frames)))  # no gap, no duplicate
    assert after[-1]["type"] == "done" and after[-1]["usage"]["completion_tokens"] == 60
    assert [f["type"] for f in after].count("done") == 1
    assert text_of(frames) == uninterrupted(smollm, frame, model)
    assert entries(redis_server.url)[1] == 0


def test_a_seeded_sampled_turn_continues_its_reply_after_a_restart(smollm, redis_server, model):
    frame = ask("t1", temperature=1.0, top_p=0.9, seed=42)
    before, after = restart_mid_reply(smollm, redis_server.url, frame, seen=6, model=model)
    assert text_of(before + tokens(after)) == uninterrupted(smollm, frame, model)


def test_a_finished_turn_is_replayed_by_the_next_process(smollm, redis_server):
    with app(smollm, redis_server.url) as first:
        first.get("/")
        cookie = dict(first.cookies)
        with first.websocket_connect("/ws") as ws:
            ws.send_json(ask("t1", max_tokens=10))
            frames = until_terminal(ws, ["t1"])["t1"]
    with app(smollm, redis_server.url) as second:
        second.cookies.update(cookie)
        with second.websocket_connect("/ws") as ws:
            ws.send_json(resume("t1", after_seq=2))  # its last frames and done were lost
            again = until_terminal(ws, ["t1"])["t1"]
        second.cookies.clear()  # another client
        with second.websocket_connect("/ws") as ws:
            ws.send_json(resume("t1", after_seq=2))
            assert ws.receive_json()["code"] == "forbidden"
    assert tokens(again) == tokens(frames)[3:] and again[-1] == frames[-1]


def test_a_silent_process_loses_its_turns_to_a_live_one(redis_server):
    async def scenario():
        record = TurnRecord("", "client:x", "c1", "t1", [Message("user", "hi")],
                            SamplingParams(temperature=0), True, None, [1, 2, 3])  # fmt: skip
        config = dict(claim_after_s=0.3)
        dead = Journal(JournalConfig(redis_server.url, consumer="dead", **config))
        live = Journal(JournalConfig(redis_server.url, consumer="live", **config))
        alive = Journal(JournalConfig(redis_server.url, consumer="alive", **config))
        for j in (dead, live, alive):
            assert await j.open() == []
        entry = await dead.accept(record, "c1")
        await dead.progress(entry, 0, "Hel", [10, 11], (3, 0))
        await dead.progress(entry, 1, "lo", [12])
        own = await alive.accept(record, "c2")
        taken = []
        for _ in range(6):  # two live processes keep their heartbeat; "dead" says nothing
            await asyncio.sleep(0.15)
            taken += await alive.maintain()
            taken += await live.maintain()
        (turn,) = taken  # taken once, by one of them; nobody took the live one's turn
        assert turn.entry.entry_id == entry.entry_id and turn.texts == ["Hel", "lo"]
        assert turn.token_ids == [10, 11, 12] and turn.start == (3, 0)
        assert replace(turn.record, nonce="") == record  # the nonce: of its accept
        await alive.finish(own, None, False, [])
        for j in (dead, live, alive):
            await j.close()

    asyncio.run(scenario())


def test_redis_down_serves_turns_without_durability_and_says_so_once(smollm, tmp_path, caplog):
    down = RedisServer(tmp_path / "redis", free_port())  # not started yet
    caplog.set_level(logging.WARNING, "app.server.journal")
    with app(smollm, down.url) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            for i in range(3):
                ws.send_json(ask(f"t{i}", f"c{i}", max_tokens=4))
                assert until_terminal(ws, [f"t{i}"])[f"t{i}"][-1]["type"] == "done"
        metrics = client.get("/metrics").text
        assert "parley:journal_up 0.0" in metrics
        assert "parley:journal_unjournaled_turns_total 3.0" in metrics
        unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(unreachable) == 1
        down.start()  # back: new turns are durable again
        try:
            wait_for(lambda: "parley:journal_up 1.0" in client.get("/metrics").text, 10)
            with client.websocket_connect("/ws") as ws:
                ws.send_json(ask("t9", "c9", max_tokens=4))
                assert until_terminal(ws, ["t9"])["t9"][-1]["type"] == "done"
            assert entries(down.url) == (1, 0)
        finally:
            down.stop()


def test_journal_required_refuses_turns_while_redis_is_down(smollm, tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with app(smollm, url, required=True) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            ws.send_json(ask("t1", max_tokens=4))
            (err,) = until_terminal(ws, ["t1"])["t1"]
            assert err["code"] == "unavailable" and err["retryable"]
            assert "journal" in err["message"]


def test_redis_lost_mid_turn_the_turn_still_completes(smollm, redis_server):
    with app(smollm, redis_server.url) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            ws.send_json(ask("t1", max_tokens=60))
            before = tokens(first_tokens(ws, 3))
            redis_server.stop()
            after = until_terminal(ws, ["t1"])["t1"]
        assert after[-1]["type"] == "done" and after[-1]["usage"]["completion_tokens"] == 60
        frames = before + tokens(after)
        assert [f["seq"] for f in frames] == list(range(len(frames)))
        # Failed round trips: the first, and those that tried again for a while.
        text = client.get("/metrics").text
        assert float(re.search(r"^parley:journal_write_errors_total (\S+)", text, re.M)[1]) >= 1


def test_the_journal_is_trimmed_of_finished_turns_past_its_bound(smollm, redis_server):
    with app(smollm, redis_server.url, max_turns=3, claim_after_s=0.3) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            for i in range(6):
                ws.send_json(ask(f"t{i}", f"c{i}", max_tokens=3))
                assert until_terminal(ws, [f"t{i}"])[f"t{i}"][-1]["type"] == "done"
        assert "parley:journal_turns_total 6.0" in client.get("/metrics").text
        # Past the bound of 3, acknowledged entries go (all of them: none is pending).
        wait_for(lambda: entries(redis_server.url)[0] <= 3, 5)
        assert entries(redis_server.url)[1] == 0
