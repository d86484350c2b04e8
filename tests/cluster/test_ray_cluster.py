"""Engine replicas on a real local Ray cluster behind the chat server: affinity, spread,
cancel across the actor boundary, a replica killed mid-stream, and no Ray at all with
one replica. Two replicas of the tiny model, one thread each."""

import os
import signal
import subprocess
import sys
import time

import pytest
from starlette.testclient import TestClient

ray = pytest.importorskip("ray")

from app.cluster.cluster import RayCluster  # noqa: E402
from app.config import ClusterConfig  # noqa: E402
from app.server.app import create_app  # noqa: E402
from tests.server.test_ws_fake import text_of, until_terminal  # noqa: E402
from tests.server.testclient import for_testclient  # noqa: E402
from tests.tiny import tiny_parts  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tokenizer):
    config, loaded = tiny_parts(tokenizer, num_blocks=512)
    # A replica that misses one heartbeat (5 s) while serving is stalled, for the SIGSTOP test.
    c = RayCluster(config, ClusterConfig(replicas=2, threads_per_replica=1, stall_s=1.0), loaded)
    with TestClient(create_app(engine=c, server_config=for_testclient())) as client:
        yield c, client
    assert not ray.is_initialized()  # stop() shut the cluster it started


def say(ws, turn, conversation, text, max_tokens=12, first=True, **params):
    # A conversation's first turn gives its history; `content` continues one held here.
    said = {"messages": [{"role": "user", "content": text}]} if first else {"content": text}
    ws.send_json({"type": "chat", "id": turn, "conversation_id": conversation, **said,
                  "params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                             **params}})  # fmt: skip
    return until_terminal(ws, [turn])[turn]


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.05)


def test_a_conversation_stays_on_its_replica_and_reuses_its_kv(cluster):
    c, client = cluster
    before = dict(c.router.decisions)
    with client.websocket_connect("/ws") as ws:
        homes = set()
        for t in range(4):
            frames = say(ws, f"t{t}", "affine-conv", f"Question number {t}?", first=t == 0)
            assert frames[-1]["type"] == "done"
            if t:
                assert frames[0]["cached_tokens"] > 0  # the previous turns' K/V, kept
            homes.add(c.router._homes[next(k for k in c.router._homes if "affine-conv" in k)])
    assert len(homes) == 1
    assert c.router.decisions["affine"] - before.get("affine", 0) == 4


def test_many_conversations_use_every_replica(cluster):
    c, client = cluster
    with client.websocket_connect("/ws") as ws:
        for i in range(8):
            assert say(ws, f"s{i}", f"spread-{i}", "Hello!", 4)[-1]["type"] == "done"
    homes = {home for key, home in c.router._homes.items() if "spread-" in key}
    assert homes == {0, 1}


def test_cancel_crosses_the_actor_boundary(cluster):
    c, client = cluster
    with client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "chat", "id": "long", "conversation_id": "cancel-conv",
                      "messages": [{"role": "user", "content": "Go on forever."}],
                      "params": {"max_tokens": 1500, "ignore_eos": True}})  # fmt: skip
        while ws.receive_json()["type"] != "token":
            pass
        ws.send_json({"type": "cancel", "id": "long"})
        frames = until_terminal(ws, ["long"])["long"]
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "cancelled"
    assert frames[-1]["usage"]["completion_tokens"] < 1500
    wait_for(lambda: c.stats().num_running == 0)


def cut_mid_reply(c, ws, name, text, seed, fault, length=300):
    """Send a seeded reply of `length` tokens, call `fault(replica)` on the replica serving
    it after 10 tokens, and check the client saw one continuous reply equal to an
    uninterrupted one (the other replica replays the sent tokens through the same random
    stream). `fault` may return a callable that undoes it, called once the reply is done.
    Returns the replica."""
    sampled = {"temperature": 5.0, "seed": seed}
    reference = say(ws, f"{name}-ref", f"{name}-ref", text, length, **sampled)
    assert reference[-1]["type"] == "done"
    params = {**sampled, "max_tokens": length, "ignore_eos": True}
    resumed = c.resumed
    ws.send_json({"type": "chat", "id": name, "conversation_id": f"{name}-conv",
                  "messages": [{"role": "user", "content": text}],
                  "params": params})  # fmt: skip
    frames = []
    while len([f for f in frames if f["type"] == "token"]) < 10:
        frames.append(ws.receive_json())
    (serving,) = set(c._where.values())
    undo = fault(serving)
    try:
        frames += until_terminal(ws, [name])[name]
    finally:
        if undo is not None:
            undo()
    tokens = [f for f in frames if f["type"] == "token"]
    assert [f["seq"] for f in tokens] == list(range(len(tokens)))  # no gap, no duplicate
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == length
    assert text_of(frames) == text_of(reference)  # the same reply as uninterrupted
    assert c.resumed == resumed + 1  # it was cut, not finished before the fault
    return serving


def test_a_replica_killed_mid_stream_leaves_one_continuous_reply(cluster):
    c, client = cluster

    def kill(replica):
        os.kill(ray.get(c.replicas[replica].pid.remote()), signal.SIGKILL)

    with client.websocket_connect("/ws") as ws:
        cut_mid_reply(c, ws, "kill", "Tell me a long story.", 7, kill)
    # Ray restarts the replica; the front takes it back; nothing is left running.
    wait_for(lambda: c.live == {0, 1}, timeout=120)
    assert client.get("/ready").status_code == 200
    wait_for(lambda: c.stats().num_running == 0 and c.stats().num_waiting == 0)


def test_a_stalled_replica_gives_its_reply_up_and_comes_back(cluster):
    """SIGSTOP (a process that keeps its sockets and answers nothing): the reply goes on
    from another replica once the stall is seen, the same reply as uninterrupted; after
    SIGCONT the replica takes work again and runs nothing for the reply it gave up."""
    c, client = cluster
    pids = {}

    def stall(replica):
        pid = pids[replica] = ray.get(c.replicas[replica].pid.remote())
        os.kill(pid, signal.SIGSTOP)
        return lambda: os.kill(pid, signal.SIGCONT)

    with client.websocket_connect("/ws") as ws:
        serving = cut_mid_reply(c, ws, "stall", "Tell me about mountains.", 5, stall)
    wait_for(lambda: c.live == {0, 1}, timeout=60)  # the same process, back
    assert ray.get(c.replicas[serving].pid.remote()) == pids[serving]
    wait_for(lambda: c.stats().num_running == 0 and c.stats().num_waiting == 0)


def test_api_requests_without_a_key_follow_their_cached_prefix(cluster):
    """Four /v1 clients share a long system prompt and send no `user`: they go where its
    blocks are (not to wherever a hash of their first tokens says) and reuse them."""
    c, client = cluster
    system = "You are the harbor master of a small northern port. " * 6
    before = dict(c.router.decisions)
    cached = []
    for question in ("Where is the ferry?", "When is high tide?", "Is it windy?", "Hi!"):
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}]}  # fmt: skip
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert c.router.decisions["prefix"] - before.get("prefix", 0) >= 3
    assert all(n >= 32 for n in cached[1:]), cached  # the system prompt's blocks, reused
    wait_for(lambda: any(c.router._held.get(r) for r in c.live))  # heartbeats publish


def test_a_request_a_replica_refuses_is_a_clear_error_and_the_rest_goes_on(cluster):
    """The engine's refusal (a prompt past the context) crosses the relay as its type."""
    c, client = cluster
    body = {"model": c.info.name, "prompt": [5] * 3000, "max_tokens": 1}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert "context" in reply.json()["error"]["message"]
    body = {"model": c.info.name, "prompt": [5] * 30, "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200


def test_routing_and_replicas_show_in_metrics(cluster):
    _, client = cluster
    text = client.get("/metrics").text
    assert 'parley:replica_up{replica="0"} 1.0' in text
    assert 'parley:routing_decisions_total{decision="affine"}' in text
    assert 'parley:routing_decisions_total{decision="prefix"}' in text


def test_one_replica_imports_no_ray():
    code = (
        "import sys\n"
        "from app.__main__ import build_parser, engine_config, server_config\n"
        "from app.server.app import _build_engine\n"
        "args = build_parser().parse_args(['--kv-cache-size', '32MiB'])\n"
        "engine = _build_engine(engine_config(args), server_config(args).cluster)\n"
        "assert type(engine).__name__ == 'AsyncEngine', type(engine)\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
