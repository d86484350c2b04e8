"""The journal under faults, on a real redis-server (paused with SIGSTOP, fed foreign and
corrupt entries) and the fake engine: a stalled accept settles instead of running its turn
twice; foreign entries are skipped; a bad record is dropped and counted, never fatal; a
process never claims its own live turns, and one whose turn was taken over while it stalled
can write no more of it."""

import asyncio
import json
import logging
import time
from dataclasses import replace

import pytest
import redis
from starlette.testclient import TestClient

from app.chat.prompt import Message
from app.engine.request import SamplingParams
from app.server import protocol as p
from app.server.app import ServerConfig, create_app
from app.server.chat_service import ChatService
from app.server.journal import GROUP, Journal, JournalConfig
from app.server.journal_records import JournalEntry, RecoveredTurn, TurnRecord
from app.server.security import Principal
from app.server.streams import Streams
from app.server.turn_runner import TurnRunner
from tests.server.fake_engine import FakeEngine
from tests.server.test_streams import resume, tokens, wait_for
from tests.server.test_ws_fake import until_terminal
from tests.server.testclient import for_testclient
from tests.tcp_proxy import TcpProxy

STREAM = "parley:turns"


@pytest.fixture
def fake(tokenizer):
    return FakeEngine(tokenizer, reply="one two three four five six")


def journal_app(engine, url, consumer="a", **journal):
    config = ServerConfig(journal=JournalConfig(url, consumer=consumer, **journal),
                          secret=b"k" * 32)  # fmt: skip
    return TestClient(create_app(engine=engine, server_config=for_testclient(config)))


def ask(id, conversation, text):
    return {"type": "chat", "id": id, "conversation_id": conversation,
            "messages": [{"role": "user", "content": text}]}  # fmt: skip


def say(id, conversation, text):
    return {"type": "chat", "id": id, "conversation_id": conversation, "content": text}


def pending(url, consumer=None):
    r = redis.Redis.from_url(url)
    if consumer is None:
        return r.xpending(STREAM, GROUP)["pending"]
    return len(r.xpending_range(STREAM, GROUP, "-", "+", 100, consumername=consumer))


def metric(client, name):
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"parley:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def record(turn_id="t1", conversation="c1"):
    return TurnRecord("", "client:x", conversation, turn_id, [Message("user", "hi")],
                      SamplingParams(temperature=0), True, None, [1, 2, 3])  # fmt: skip


# -- A1: an accept that times out while Redis stalls ---------------------------------------


def test_a_stalled_accept_neither_runs_its_turn_again_nor_erases_the_next(fake, redis_server):
    with journal_app(fake, redis_server.url, timeout_s=0.5, claim_after_s=0.6) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            redis_server.pause()  # the accept's MULTI waits in Redis's socket buffer
            began = time.monotonic()
            try:
                ws.send_json(ask("t1", "c1", "first question"))
                assert until_terminal(ws, ["t1"])["t1"][-1]["type"] == "done"  # unjournaled
            finally:
                time.sleep(max(0.0, 1.5 - (time.monotonic() - began)))
                redis_server.resume()  # whatever it had received runs now
            wait_for(lambda: metric(client, "journal_up") == 1.0, 10)
            ws.send_json(say("t2", "c1", "second question"))
            assert until_terminal(ws, ["t2"])["t2"][-1]["type"] == "done"
            time.sleep(2.0)  # three times claim_after: a stale entry would be claimed by now
            ws.send_json(say("t3", "c1", "third question"))
            assert until_terminal(ws, ["t3"])["t3"][-1]["type"] == "done"
    assert len(fake.prompts) == 3  # t1 ran once
    last = fake.tokenizer.decode(list(fake.prompts.values())[-1])
    assert "first question" in last and "second question" in last  # nothing erased
    assert pending(redis_server.url) == 0


def test_a_recovered_turn_never_overwrites_a_newer_history(fake):
    chat = ChatService(fake)
    who = Principal("", "client:x")
    params = SamplingParams()
    first = chat.begin_turn(p.ChatFrame("t1", "c1", [Message("user", "u1")], None, None,
                                        params), who)  # fmt: skip
    chat.end_turn(first, "a1", None)
    second = chat.begin_turn(p.ChatFrame("t2", "c1", None, "u2", None, params), who)
    chat.end_turn(second, "a2", None)
    # t1 again, from the journal (an entry left over from a stall): it answers an older
    # history, and must not take the conversation back to it.
    late = chat.recovered_turn(p.ChatFrame("t1", "c1", [Message("user", "u1")], None, None,
                                           params), who)  # fmt: skip
    chat.end_turn(late, "a1 again", None)
    conv = chat.store.find("", "c1")
    assert [m.content for m in conv.messages] == ["u1", "a1", "u2", "a2"]


# -- A2: an entry that is not ours ----------------------------------------------------------


def test_a_foreign_entry_is_skipped_and_breaks_nothing(fake, redis_server):
    url = redis_server.url
    with journal_app(fake, url, required=True, claim_after_s=0.6) as client:
        client.get("/")
        redis.Redis.from_url(url).xadd(STREAM, {"hello": "world"})
        with client.websocket_connect("/ws") as ws:
            for i in range(3):
                ws.send_json(ask(f"t{i}", f"c{i}", "hi"))
                frames = until_terminal(ws, [f"t{i}"])[f"t{i}"]
                assert frames[-1]["type"] == "done", frames[-1]
        time.sleep(2.0)  # past claim_after: nothing is taken up again
        assert metric(client, "journal_up") == 1.0
        assert metric(client, "journal_turns_total") == 3.0
        assert metric(client, "journal_skipped_entries_total") == 1.0
    assert len(fake.prompts) == 3
    assert pending(url) == 0


# -- A3: records that are not ours, or not whole --------------------------------------------

HEADER = record().to_json()
BAD_RECORDS = {
    "a list for a header": ["[1, 2]"],
    "not JSON": ["{oops"],
    "a header without fields": ['{"v": 1}'],
    "params of the wrong type": [HEADER.replace('"temperature":0', '"temperature":"hot"')],
    "a frame that is a list": [HEADER, "[0]"],
    "a frame whose seq is text": [HEADER, '{"s": "zero", "t": "x", "i": []}'],
    "token ids that are not ids": [HEADER, '{"s": 0, "t": "x", "i": ["a"]}'],
    "token ids out of the vocabulary": [HEADER, '{"s": 0, "t": "x", "i": [99999999]}'],
    "a start that is a number": [HEADER, '{"s": 0, "t": "x", "i": [5], "start": 7}'],
    "prompt ids that are not ids": [HEADER.replace('"prompt":[1,2,3]', '"prompt":{"a":1}')],
}


def plant(url, consumer, records):
    """Entries pending under `consumer`, each naming one of `records`."""
    r = redis.Redis.from_url(url)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for i, items in enumerate(records):
        key = f"parley:rec:bad{consumer}{i}"
        r.rpush(key, *items)
        r.xadd(STREAM, {"rec": key, "v": 1})
    r.xadd(STREAM, {"hello": "world"})  # and one that is no turn at all
    r.xreadgroup(GROUP, consumer, {STREAM: ">"})


def test_bad_records_are_dropped_logged_once_and_counted(fake, redis_server, caplog):
    caplog.set_level(logging.WARNING, "app.server.journal")
    plant(redis_server.url, "a", BAD_RECORDS.values())
    with journal_app(fake, redis_server.url) as client:  # it starts
        client.get("/")
        assert metric(client, "journal_dropped_entries_total") == len(BAD_RECORDS) + 1
        with client.websocket_connect("/ws") as ws:
            ws.send_json(ask("ok", "c9", "hi"))
            assert until_terminal(ws, ["ok"])["ok"][-1]["type"] == "done"
    dropped = [r for r in caplog.records if "dropping it" in r.getMessage()]
    assert len(dropped) == len(BAD_RECORDS) + 1  # once each
    assert pending(redis_server.url) == 0


def test_bad_records_of_a_silent_process_do_not_stop_the_upkeep(fake, redis_server):
    plant(redis_server.url, "gone", BAD_RECORDS.values())
    with journal_app(fake, redis_server.url, claim_after_s=0.3) as client:
        client.get("/")
        wait_for(lambda: metric(client, "journal_dropped_entries_total") >= len(BAD_RECORDS), 10)
        with client.websocket_connect("/ws") as ws:
            ws.send_json(ask("ok", "c9", "hi"))
            assert until_terminal(ws, ["ok"])["ok"][-1]["type"] == "done"
        wait_for(lambda: pending(redis_server.url) == 0, 5)


# -- A4: claims --------------------------------------------------------------------------


def test_a_stalled_process_never_claims_its_own_live_turn(redis_server):
    async def scenario():
        journal = Journal(JournalConfig(redis_server.url, consumer="a", claim_after_s=0.3))
        await journal.open()
        entry = await journal.accept(record(), "c1")
        await journal.maintain()  # its scripts are loaded: one round trip each from here

        async def stall():
            await asyncio.sleep(0)
            time.sleep(0.5)  # the event loop stalls after the heartbeat was sent

        claimed, _ = await asyncio.gather(journal.maintain(), stall())
        assert claimed == []
        assert await journal.progress(entry, 0, "Hi", [5], (3, 0))
        await journal.close()

    asyncio.run(scenario())


def test_a_turn_taken_over_while_its_process_stalled_gets_no_more_writes_from_it(redis_server):
    async def scenario():
        config = dict(claim_after_s=0.3)
        a = Journal(JournalConfig(redis_server.url, consumer="a", **config))
        b = Journal(JournalConfig(redis_server.url, consumer="b", **config))
        await a.open()
        await b.open()
        entry = await a.accept(record(), "c1")
        assert await a.progress(entry, 0, "Hel", [10], (3, 0))
        time.sleep(0.5)  # a's loop stalls: no heartbeat
        (turn,) = await b.maintain()  # b takes it over
        assert turn.texts == ["Hel"]
        assert not await a.progress(entry, 1, "lo", [11])  # a wakes up: fenced off
        assert entry.lost
        await a.finish(entry, None, False, [])  # and cannot end it either
        assert await b.progress(turn.entry, 1, "lo!", [12])
        await b.finish(turn.entry, '{"type":"done"}', True, [])
        r = redis.Redis.from_url(redis_server.url)
        items = r.lrange(turn.entry.record_key, 0, -1)
        seqs = [int(i.split(b'"s":')[1].split(b",")[0]) for i in items[1:-1]]
        assert seqs == [0, 1] and b'"lo!"' in items[2]
        assert sum(b'"end"' in i for i in items) == 1
        for j in (a, b):
            await j.close()

    asyncio.run(scenario())


def test_a_turn_whose_own_end_is_in_flight_is_not_taken_for_taken_over(redis_server):
    """The upkeep's heartbeat and a turn's end race on two connections: the end's script
    runs first, its answer not back yet, when the heartbeat's answer arrives. The entry is
    pending under nobody then; only one another process holds is lost (CI caught a turn
    ended `done` in its record and `unavailable` to its client)."""

    async def scenario():
        journal = Journal(JournalConfig(redis_server.url, consumer="a", claim_after_s=0.3))
        await journal.open()
        ended = await journal.accept(record("t1", "c1"), "c1")
        taken = await journal.accept(record("t2", "c2"), "c2")
        for entry in (ended, taken):
            assert await journal.progress(entry, 0, "Hi", [5], (3, 0))
        r = redis.Redis.from_url(redis_server.url)
        r.xack(STREAM, GROUP, ended.entry_id)  # its end ran in Redis, the answer on its way
        r.xclaim(STREAM, GROUP, "b", 0, [taken.entry_id])  # another process took this one
        await journal.maintain()
        assert not ended.lost and taken.lost
        assert journal.stats().taken_over == 1
        await journal.close()

    asyncio.run(scenario())


class HeldRound:
    """A journal whose upkeep round has claimed a turn and waits (its reads on the way)
    until the test lets it return."""

    def __init__(self, turn: RecoveredTurn) -> None:
        self.turn, self.claimed, self.go = turn, asyncio.Event(), asyncio.Event()

    async def maintain(self) -> list[RecoveredTurn]:
        self.claimed.set()
        await self.go.wait()
        return [self.turn]

    async def find_finished(self, conversation_key, turn_id):
        return None


class Frames:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def send(self, text: str) -> bool:
        self.sent.append(json.loads(text))
        return True

    def release(self, stream) -> None:
        pass


def test_a_resume_that_arrives_while_its_turn_is_being_claimed_waits_for_the_claim(fake):
    """The stalled process tells its client to resume as soon as it finds its turn taken
    over; the resume can reach the taker before the taker's round has opened the turn's
    stream. It waits for the round instead of answering unknown_id."""
    end = p.done_frame("t1", "stop", p.Usage(3, 1, 0), p.Timings(None, None, None, None))
    turn = RecoveredTurn(JournalEntry("1-0", "parley:rec:x"), record(), ["Hi"], [5], (3, 0),
                         end, True)  # fmt: skip

    async def scenario():
        journal = HeldRound(turn)
        runner = TurnRunner(ChatService(fake), Streams(), journal)
        upkeep = asyncio.create_task(runner.keep_journal())
        await journal.claimed.wait()
        sink = Frames()
        resume = asyncio.create_task(
            runner.resume(p.ResumeFrame("t1", "c1", -1), Principal("", "client:x"), sink)
        )
        await asyncio.sleep(0.05)
        assert not resume.done()  # it waits for the round
        journal.go.set()
        await upkeep
        await (await resume).ended()
        return sink.sent

    sent = asyncio.run(scenario())
    assert [f["type"] for f in sent] == ["start", "token", "done"]


class StallingEngine(FakeEngine):
    """Blocks its event loop once, after `after` words: the whole process stalls."""

    def __init__(self, tokenizer, after: int, stall_s: float) -> None:
        super().__init__(tokenizer, delay=0.02, reply=" ".join(f"w{i}" for i in range(40)))
        self.after, self.stall_s = after, stall_s

    async def generate(self, asked):
        n = 0
        async for out in super().generate(asked):
            n += 1
            if n == self.after:
                time.sleep(self.stall_s)
            yield out


class StallingAtTheEnd(FakeEngine):
    """Blocks its event loop once, after its last word and before it says it is done:
    every frame is recorded, the end not yet."""

    def __init__(self, tokenizer, stall_s: float) -> None:
        super().__init__(tokenizer, delay=0.02, reply=" ".join(f"w{i}" for i in range(10)))
        self.stall_s = stall_s

    async def generate(self, asked):
        async for out in super().generate(asked):
            if not out.finished:
                yield out
                continue
            yield replace(out, finished=False, finish_reason=None)
            await asyncio.sleep(0.2)  # the runner records the last frame
            time.sleep(self.stall_s)
            yield replace(out, new_text="", new_token_ids=[])


@pytest.mark.parametrize("where", ["mid-reply", "before its end"])
def test_a_turn_taken_over_stops_on_the_stalled_server_and_ends_once(tokenizer, redis_server,
                                                                      where):  # fmt: skip
    url = redis_server.url
    if where == "mid-reply":
        stalling = StallingEngine(tokenizer, after=5, stall_s=3.0)
    else:
        stalling = StallingAtTheEnd(tokenizer, stall_s=3.0)
    other = FakeEngine(tokenizer, delay=0.02, reply=" ".join(f"w{i}" for i in range(40)))
    with journal_app(stalling, url, "a", claim_after_s=0.5) as a:
        a.get("/")
        with journal_app(other, url, "b", claim_after_s=0.5) as b:
            b.cookies.update(dict(a.cookies))  # the same browser
            with a.websocket_connect("/ws") as ws:
                ws.send_json(ask("t1", "c1", "hi"))
                seen = until_terminal(ws, ["t1"])["t1"]
            assert seen[-1]["type"] == "error" and seen[-1]["code"] == p.UNAVAILABLE
            assert stalling.aborted or where == "before its end"  # a stopped its run
            last = max([f["seq"] for f in tokens(seen)], default=-1)
            with b.websocket_connect("/ws") as ws:
                ws.send_json(resume("t1", "c1", last))
                rest = until_terminal(ws, ["t1"])["t1"]
            assert rest[-1]["type"] == "done", rest[-1]
            (key,) = redis.Redis.from_url(url).keys("parley:rec:*")
            end = redis.Redis.from_url(url).lrange(key, -1, -1)[0]
            assert json.loads(json.loads(end)["end"]) == rest[-1]  # the one end there is
            frames = tokens(seen) + tokens(rest)
            assert [f["seq"] for f in frames] == list(range(len(frames)))
            wait_for(lambda: pending(url) == 0, 5)
            with a.websocket_connect("/ws") as ws:  # a's history of c1 is stale: forgotten
                ws.send_json(say("t2", "c1", "and then?"))
                (err,) = until_terminal(ws, ["t2"])["t2"]
                assert err["code"] == p.UNKNOWN_CONVERSATION


def test_an_accept_whose_answer_was_lost_is_settled_and_never_taken_up(redis_server):
    proxy = TcpProxy(redis_server.port)
    url = f"redis://127.0.0.1:{proxy.port}/0"

    async def scenario():
        journal = Journal(JournalConfig(url, consumer="a", claim_after_s=0.6, timeout_s=0.5))
        await journal.open()
        proxy.hold()  # the accept reaches Redis and runs there; its answer does not come back
        try:
            assert await journal.accept(record(), "c1") is None  # served unjournaled
            assert pending(redis_server.url, "a") == 1  # yet it happened
        finally:
            proxy.release()
        taken = []
        for _ in range(10):  # past claim_after: a stale entry would be taken up by now
            await asyncio.sleep(0.2)
            taken += await journal.maintain()
        assert taken == [] and journal.stats().settled == 1
        assert pending(redis_server.url) == 0
        assert not redis.Redis.from_url(redis_server.url).keys("parley:rec:*")
        await journal.close()

    try:
        asyncio.run(scenario())
    finally:
        proxy.close()


def test_a_turn_that_lost_a_write_is_abandoned_once_redis_answers(redis_server):
    async def scenario():
        journal = Journal(JournalConfig(redis_server.url, consumer="a", claim_after_s=0.6,
                                        timeout_s=0.5))  # fmt: skip
        await journal.open()
        entry = await journal.accept(record(), "c1")
        assert await journal.progress(entry, 0, "Hel", [10], (3, 0))
        redis_server.pause()
        try:
            assert not await journal.progress(entry, 1, "lo", [11])  # runs on unjournaled
        finally:
            redis_server.resume()
        for _ in range(10):  # the turn is still running: nobody may take it up
            await asyncio.sleep(0.2)
            assert await journal.maintain() == []
        assert pending(redis_server.url) == 0  # abandoned while it ran, not at its end
        assert not redis.Redis.from_url(redis_server.url).keys("parley:rec:*")
        await journal.finish(entry, '{"type":"done"}', True, [])
        await journal.close()

    asyncio.run(scenario())


def test_a_turn_that_never_showed_a_frame_is_not_taken_up(redis_server):
    """Its start frame waits for its first frame's record: with none recorded, no client
    saw it begin (its accept's answer may never have come back), and nobody runs it."""

    async def scenario():
        first = Journal(JournalConfig(redis_server.url, consumer="a"))
        await first.open()
        await first.accept(record(), "c1")  # ... and the process dies in the prefill
        again = Journal(JournalConfig(redis_server.url, consumer="a"))
        assert await again.open() == []
        assert again.stats().dropped == 1 and pending(redis_server.url) == 0
        assert not redis.Redis.from_url(redis_server.url).keys("parley:rec:*")
        for j in (first, again):
            await j.close()

    asyncio.run(scenario())


def test_a_stale_accept_of_a_turn_accepted_again_is_dropped_not_run(redis_server):
    async def scenario():
        config = dict(claim_after_s=0.3)
        a = Journal(JournalConfig(redis_server.url, consumer="a", **config))
        b = Journal(JournalConfig(redis_server.url, consumer="b", **config))
        for j in (a, b):
            await j.open()
        stale = await a.accept(record(), "c1")  # as if its answer had been lost
        a._live.pop(stale.entry_id)  # ... so this process does not know of it
        again = await a.accept(record(), "c1")  # the client asked again: same turn id
        assert await a.progress(again, 0, "Hi", [5], (3, 0))
        time.sleep(0.5)  # the stale entry idles past claim_after; a's own is refreshed
        # Whichever claims the stale one drops it, and leaves the record alone.
        assert await a.maintain() == [] and await b.maintain() == []
        assert a.stats().dropped + b.stats().dropped == 1
        assert await a.progress(again, 1, " there", [6])
        await a.finish(again, '{"type":"done"}', True, [])
        assert pending(redis_server.url) == 0
        for j in (a, b):
            await j.close()

    asyncio.run(scenario())


# -- writes that fail ---------------------------------------------------------------------


def test_a_write_whose_answer_was_lost_is_tried_again_and_not_doubled(redis_server):
    proxy = TcpProxy(redis_server.port)
    url = f"redis://127.0.0.1:{proxy.port}/0"

    async def scenario():
        journal = Journal(JournalConfig(url, consumer="a", timeout_s=0.5))
        await journal.open()
        entry = await journal.accept(record(), "c1")
        assert await journal.progress(entry, 0, "Hel", [10], (3, 0))
        proxy.hold()  # the write runs in Redis; its answer does not come back
        later = asyncio.get_running_loop().call_later(0.8, proxy.release)
        assert await journal.progress(entry, 1, "lo", [11])  # tried again: it had landed
        later.cancel()
        assert await journal.progress(entry, 2, "!", [12])
        items = redis.Redis.from_url(redis_server.url).lrange(entry.record_key, 0, -1)
        assert [json.loads(i)["s"] for i in items[1:]] == [0, 1, 2]
        await journal.finish(entry, '{"type":"done"}', True, [])
        await journal.close()

    try:
        asyncio.run(scenario())
    finally:
        proxy.close()


def test_required_a_short_redis_stall_mid_reply_only_pauses_it(fake, redis_server):
    fake.reply = " ".join(f"w{i}" for i in range(30))
    fake.delay = 0.02
    url = redis_server.url
    with journal_app(fake, url, required=True, timeout_s=0.5, claim_after_s=3.0) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            ws.send_json(ask("t1", "c1", "hi"))
            frames = [ws.receive_json() for _ in range(4)]  # start, and some tokens
            redis_server.pause()
            time.sleep(0.4)  # under twice the timeout: the writes are tried again
            redis_server.resume()
            frames += until_terminal(ws, ["t1"])["t1"]
        assert frames[-1]["type"] == "done"
        seqs = [f["seq"] for f in tokens(frames)]
        assert seqs == list(range(30))
    (key,) = redis.Redis.from_url(url).keys("parley:rec:*")
    assert (
        json.loads(json.loads(redis.Redis.from_url(url).lrange(key, -1, -1)[0])["end"])
        == (frames[-1])
    )


def test_required_a_long_redis_stall_mid_reply_stops_it_and_it_goes_on_from_its_record(
    fake, redis_server
):
    fake.reply = " ".join(f"w{i}" for i in range(30))
    fake.delay = 0.02
    url = redis_server.url
    with journal_app(fake, url, required=True, timeout_s=0.3, claim_after_s=3.0) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            ws.send_json(ask("t1", "c1", "hi"))
            seen = [ws.receive_json() for _ in range(4)]
            redis_server.pause()
            try:
                seen += until_terminal(ws, ["t1"])["t1"]  # past twice the timeout
            finally:
                redis_server.resume()
            assert seen[-1]["code"] == p.UNAVAILABLE and "resume" in seen[-1]["message"]
            last = max(f["seq"] for f in tokens(seen))
            deadline = time.monotonic() + 10
            while True:  # the server takes it back from its record once Redis answers
                ws.send_json(resume("t1", "c1", last))
                rest = until_terminal(ws, ["t1"])["t1"]
                if rest[-1]["type"] == "done" or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert rest[-1]["type"] == "done", rest[-1]
        frames = tokens(seen) + [f for f in tokens(rest) if f["seq"] > last]
        assert [f["seq"] for f in frames] == list(range(len(frames)))
        wait_for(lambda: pending(url) == 0, 5)
    r = redis.Redis.from_url(url)
    (key,) = r.keys("parley:rec:*")
    items = r.lrange(key, 0, -1)
    recorded = [json.loads(i)["t"] for i in items[1:-1]]
    assert [f["text"] for f in frames] == recorded  # nothing was sent unrecorded
    assert json.loads(json.loads(items[-1])["end"]) == rest[-1]


def test_required_a_stall_before_the_first_frame_refuses_the_turn_and_it_can_be_sent_again(
    fake, redis_server
):
    fake.reply = "one two three"
    fake.delay = 0.3
    url = redis_server.url
    with journal_app(fake, url, required=True, timeout_s=0.3, claim_after_s=3.0) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            ws.send_json(ask("t1", "c1", "hi"))
            time.sleep(0.1)  # accepted; its first frame is not written yet
            redis_server.pause()
            try:
                (err,) = until_terminal(ws, ["t1"])["t1"]  # no start: nothing was shown
            finally:
                redis_server.resume()
            assert err["code"] == p.UNAVAILABLE
            wait_for(lambda: metric(client, "journal_up") == 1.0, 10)
            time.sleep(0.5)  # the server takes back what it released (and drops it)
            ws.send_json(ask("t1", "c1", "hi"))  # so the client sends it again
            frames = until_terminal(ws, ["t1"])["t1"]
        assert frames[0]["type"] == "start" and frames[-1]["type"] == "done"
        wait_for(lambda: pending(url) == 0, 5)
