"""Two replicas sharing a KV tier in a real Redis: a conversation moved off its busy home
replica finds its K/V in the tier on the other one, instead of recomputing its history."""

import time

import pytest
from starlette.testclient import TestClient

ray = pytest.importorskip("ray")

from app.cluster.cluster import RayCluster  # noqa: E402
from app.config import ClusterConfig, TierConfig  # noqa: E402
from app.server.app import create_app  # noqa: E402
from tests.server.test_ws_fake import until_terminal  # noqa: E402
from tests.server.testclient import for_testclient  # noqa: E402
from tests.tiny import tiny_parts  # noqa: E402

HISTORY = "Tell me everything about rivers, mountains, harbors and lighthouses, in order. " * 3


def home_of(c: RayCluster, conversation: str) -> int:
    return next(home for key, home in c.router._homes.items() if conversation in key)


def send(ws, turn: str, conversation: str, text: str, max_tokens: int, first=True) -> None:
    params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    # A conversation's first turn gives its history; `content` continues one held here.
    said = {"messages": [{"role": "user", "content": text}]} if first else {"content": text}
    ws.send_json({"type": "chat", "id": turn, "conversation_id": conversation, **said,
                  "params": params})  # fmt: skip


def test_a_rebalanced_conversation_loads_its_kv_from_the_shared_tier(tokenizer, redis_server):
    tier = TierConfig("redis", redis_server.url, store="finish", min_load_speedup=0)
    config, loaded = tiny_parts(tokenizer, num_blocks=512, tier=tier)
    # Threshold 0: one request more on the home than elsewhere moves the conversation.
    cluster = RayCluster(
        config, ClusterConfig(replicas=2, threads_per_replica=1, rebalance_threshold=0), loaded
    )
    with (
        TestClient(create_app(engine=cluster, server_config=for_testclient())) as client,
        client.websocket_connect("/ws") as ws,
    ):
        send(ws, "t1", "moving", HISTORY, 8)
        first = until_terminal(ws, ["t1"])["t1"]
        assert first[-1]["type"] == "done" and first[0]["tier_cached_tokens"] == 0
        home = home_of(cluster, "moving")
        time.sleep(1.0)  # the finished turn's blocks are written by a background worker

        # Keep the home busier than the other replica: long replies of other conversations.
        busy, load = [], {0: 0, 1: 0}
        for i in range(6):  # (at most 8 turns in flight on one socket)
            send(ws, f"b{i}", f"busy-{i}", "Go on.", 1900)
            while ws.receive_json()["type"] != "start":
                pass
            busy.append(f"b{i}")
            load[home_of(cluster, f"busy-{i}")] += 1
            if load[home] > load[1 - home]:
                break
        assert load[home] > load[1 - home]
        before = cluster.router.decisions["rebalanced"]

        send(ws, "t2", "moving", "And the sea?", 8, first=False)
        frames = until_terminal(ws, ["t2"])["t2"]
        for turn in busy:
            ws.send_json({"type": "cancel", "id": turn})
        until_terminal(ws, busy)

    assert cluster.router.decisions["rebalanced"] == before + 1
    assert home_of(cluster, "moving") != home
    start, done = frames[0], frames[-1]
    assert done["type"] == "done"
    # The history's full blocks came back: from Redis, but for the chat template's first
    # block, which the busy conversations left in the new replica's own pool.
    assert start["tier_cached_tokens"] >= 32
    assert start["cached_tokens"] >= first[0]["prompt_tokens"] // 16 * 16
