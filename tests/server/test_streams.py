"""Turns that outlive their socket (fake engine): resume by seq, grace periods, limits,
ownership, and a storm of dropped sockets."""

import threading
import time

import pytest
from starlette.testclient import TestClient

from app.engine.async_engine import AsyncEngine
from app.server.app import ServerConfig, create_app
from app.server.streams import StreamsConfig
from tests.server.fake_engine import FakeEngine
from tests.server.test_ws_fake import chat, say, text_of, until_terminal
from tests.server.testclient import for_testclient
from tests.tiny import tiny_engine

WORDS = " ".join(f"w{i}" for i in range(40))


@pytest.fixture
def fake(tokenizer):
    return FakeEngine(tokenizer, delay=0.01, reply=WORDS)


def app_client(fake, **streams):
    config = ServerConfig(streams=StreamsConfig(**streams))
    client = TestClient(create_app(engine=fake, server_config=for_testclient(config)))
    return client


@pytest.fixture
def client(fake):
    with app_client(fake) as c:
        c.get("/")  # a browser lineage (cookie): its sockets are one client
        yield c


def tokens(frames):
    """The token frames, without their token counts (which text replayed from the journal
    does not have)."""
    return [
        {k: v for k, v in f.items() if k != "completion_tokens"}
        for f in frames
        if f["type"] == "token"
    ]


def first_tokens(ws, n):
    """Frames until the n-th token frame."""
    frames = []
    while len(tokens(frames)) < n:
        frames.append(ws.receive_json())
    return frames


def resume(id, conversation="c1", after_seq=-1):
    return {"type": "resume", "id": id, "conversation_id": conversation, "after_seq": after_seq}


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_turn_resumed_on_a_new_socket_has_no_gap_and_no_duplicate(client, fake):
    with client.websocket_connect("/ws") as ws:
        ws.send_json(chat("t1"))
        before = first_tokens(ws, 5)
    seen = tokens(before)[-1]["seq"]
    time.sleep(0.1)  # the turn runs on without a socket
    with client.websocket_connect("/ws") as ws:
        ws.send_json(resume("t1", after_seq=seen - 2))  # it read two of them again
        after = until_terminal(ws, ["t1"])["t1"]
    assert after[0]["type"] == "start"  # the start frame again, then the tokens
    frames = tokens(before)[: seen - 1] + tokens(after)
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    assert text_of(frames) == WORDS
    assert [f["type"] for f in after].count("done") == 1 and after[-1]["type"] == "done"
    assert after[-1]["usage"]["completion_tokens"] == 40
    assert not fake.aborted


def test_a_finished_turn_whose_done_was_lost_is_replayed(client):
    with client.websocket_connect("/ws") as ws:
        ws.send_json(chat("t1"))
        first_tokens(ws, 1)
    time.sleep(0.8)  # it finishes meanwhile
    with client.websocket_connect("/ws") as ws:
        ws.send_json(resume("t1", after_seq=0))
        frames = until_terminal(ws, ["t1"])["t1"]
    assert [f["seq"] for f in tokens(frames)] == list(range(1, 40))
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "stop"


def test_a_turn_nobody_resumes_is_cancelled_after_the_grace_period(fake):
    fake.reply = " ".join(f"w{i}" for i in range(2000))
    with app_client(fake, grace_s=0.3) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            ws.send_json(chat("t1"))
            first_tokens(ws, 2)
        time.sleep(0.1)
        assert fake.live and not fake.aborted  # still running, detached
        wait_for(lambda: not fake.live)
        assert fake.aborted
        with client.websocket_connect("/ws") as ws:
            ws.send_json(resume("t1"))
            err = ws.receive_json()
            assert err["type"] == "error" and err["code"] == "expired" and err["id"] == "t1"
            # The conversation is free again, and keeps the partial reply.
            fake.reply = "next"
            ws.send_json(say("t2", content="more"))
            assert text_of(until_terminal(ws, ["t2"])["t2"]) == "next"
        metrics = client.get("/metrics").text
        assert "parley:turns_expired_total 1.0" in metrics


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (resume("never"), "unknown_id"),
        (resume("t1", conversation="other"), "unknown_id"),
        ({"type": "resume", "id": "t1", "conversation_id": "c1", "after_seq": -2}, "bad_request"),
        ({"type": "resume", "id": "t1", "conversation_id": "c1", "after_seq": "3"}, "bad_request"),
        ({"type": "resume", "id": "t1"}, "bad_request"),
        (resume("t1", after_seq=10_000), "expired"),
    ],
)
def test_resume_errors(client, frame, code):
    with client.websocket_connect("/ws") as ws:
        ws.send_json(chat("t1"))
        first_tokens(ws, 1)
    with client.websocket_connect("/ws") as ws:
        ws.send_json(frame)
        err = ws.receive_json()
        assert err["type"] == "error" and err["code"] == code and err["message"]
        ws.send_json(resume("t1"))  # the socket stays usable
        assert until_terminal(ws, ["t1"])["t1"][-1]["type"] == "done"


def test_another_client_cannot_resume_a_turn(fake):
    with app_client(fake) as client:
        client.cookies.clear()  # no cookies: every socket is a client of its own
        with client.websocket_connect("/ws") as alice:
            alice.send_json(chat("t1", content="my secret"))
            first_tokens(alice, 2)
            with client.websocket_connect("/ws") as mallory:
                mallory.send_json(resume("t1"))
                (err,) = until_terminal(mallory, ["t1"])["t1"]
                assert err["code"] == "forbidden"
            rest = until_terminal(alice, ["t1"])["t1"]  # Alice's turn is untouched
            assert rest[-1]["type"] == "done"
        with client.websocket_connect("/ws") as mallory:  # nor after it ended
            mallory.send_json(resume("t1", after_seq=0))
            assert mallory.receive_json()["code"] == "forbidden"


def test_resume_takes_a_turn_over_from_a_socket_that_still_looks_open(client, fake):
    with client.websocket_connect("/ws") as old:
        old.send_json(chat("t1"))
        seen = tokens(first_tokens(old, 3))[-1]["seq"]
        with client.websocket_connect("/ws") as new:
            new.send_json(resume("t1", after_seq=seen))
            frames = until_terminal(new, ["t1"])["t1"]
        assert tokens(frames)[0]["seq"] == seen + 1 and frames[-1]["type"] == "done"
        # The old socket lost the turn: a cancel there no longer reaches it.
        old.send_json({"type": "cancel", "id": "t1"})
        while (f := old.receive_json())["type"] != "error":
            assert f["type"] == "token"  # at most what was already on its way
        assert f["code"] == "unknown_id"
    assert not fake.aborted


def test_delete_cancels_a_detached_turn(client, fake):
    fake.reply = " ".join(f"w{i}" for i in range(2000))
    with client.websocket_connect("/ws") as ws:
        ws.send_json(chat("t1", "gone"))
        first_tokens(ws, 1)
    with client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "delete", "conversation_id": "gone"})
        assert ws.receive_json()["type"] == "deleted"
    wait_for(lambda: not fake.live)
    assert fake.aborted


def test_a_storm_of_dropped_sockets_loses_no_turn(client, fake):
    """50 sockets dropped mid-reply, each turn resumed on a new socket."""
    fake.delay = 0.005
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def user(i):
        try:
            with client.websocket_connect("/ws") as ws:
                ws.send_json(chat(f"t{i}", f"storm-{i}"))
                before = tokens(first_tokens(ws, 1 + i % 7))
            with client.websocket_connect("/ws") as ws:
                ws.send_json(resume(f"t{i}", f"storm-{i}", before[-1]["seq"]))
                results[i] = before + until_terminal(ws, [f"t{i}"])[f"t{i}"]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(results) == 50
    for frames in results.values():
        assert [f["seq"] for f in tokens(frames)] == list(range(40))
        assert text_of(frames) == WORDS
        assert [f["type"] for f in frames].count("done") == 1
    wait_for(lambda: not fake.live)
    assert not fake.aborted
    metrics = client.get("/metrics").text
    assert "parley:turn_resumes_total 50.0" in metrics
    assert "parley:turns_detached 0.0" in metrics


def test_a_new_turn_supersedes_the_one_its_client_left_behind(client, fake):
    fake.reply = " ".join(f"w{i}" for i in range(2000))
    with client.websocket_connect("/ws") as ws:
        ws.send_json(chat("t1"))
        first_tokens(ws, 1)
        with client.websocket_connect("/ws") as other:  # still attached: the turn is busy
            other.send_json(say("t2", content="again"))
            assert until_terminal(other, ["t2"])["t2"][0]["code"] == "conversation_busy"
    with client.websocket_connect("/ws") as ws:  # detached now: the new turn replaces it
        fake.reply = "fresh"
        ws.send_json(say("t2", content="again"))
        assert text_of(until_terminal(ws, ["t2"])["t2"]) == "fresh"
        ws.send_json(resume("t1"))
        assert ws.receive_json()["code"] == "expired"
    assert len(fake.aborted) == 1


def test_a_cancel_that_comes_before_the_engine_has_the_request_still_stops_it(tokenizer):
    engine = AsyncEngine(tiny_engine(tokenizer))
    with (
        TestClient(create_app(engine=engine, server_config=for_testclient())) as client,
        client.websocket_connect("/ws") as ws,
    ):
        params = {"max_tokens": 1000, "ignore_eos": True}
        long = "word " * 2000  # rendered on a worker thread: the cancel comes meanwhile
        ws.send_json(chat("t1", content=long, params=params))
        ws.send_json({"type": "cancel", "id": "t1"})  # the engine has not seen it yet
        frames = until_terminal(ws, ["t1"])["t1"]
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "cancelled"
    assert frames[-1]["usage"]["completion_tokens"] < 1000


def test_deleting_a_conversation_whose_turn_runs_detached_leaves_no_block(tokenizer):
    engine = AsyncEngine(tiny_engine(tokenizer))
    with TestClient(create_app(engine=engine, server_config=for_testclient())) as client:
        client.get("/")
        params = {"max_tokens": 1000, "ignore_eos": True}
        with client.websocket_connect("/ws") as ws:
            ws.send_json(chat("t1", "doomed", params=params))
            first_tokens(ws, 2)
        with client.websocket_connect("/ws") as ws:
            ws.send_json({"type": "delete", "conversation_id": "doomed"})
            assert ws.receive_json()["type"] == "deleted"
        pool = engine.engine.kv.pool
        wait_for(lambda: pool.num_free_blocks == pool.num_blocks)
        assert engine.stats().sessions_pinned == 0
