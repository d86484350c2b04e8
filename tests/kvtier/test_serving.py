"""The tier behind real engines and servers: the real model's fp32 reply after a restore,
two servers sharing one Redis, and /ready while Redis is gone."""

import json
from pathlib import Path

import httpx
from starlette.testclient import TestClient
from websockets.sync.client import connect

from app.config import CacheConfig, EngineConfig, ModelConfig, TierConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.server.app import create_app
from tests.e2e.live_server import live_server
from tests.engine.util import run
from tests.redis_server import RedisServer, redis_or_skip
from tests.server.testclient import for_testclient
from tests.tiny import tiny_engine

ESSAY = (Path(__file__).parent.parent / "data" / "essays.txt").read_text()[:2000]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


def forget_pool(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    pool.free(pool.allocate(pool.num_free_blocks))


def _second_turn(smollm, model: ModelConfig, via_tier: bool) -> list[int]:
    """A first turn over an essay, then a second whose history comes back from the tier
    (its pin and the pool's blocks dropped) or from the pool; returns the second reply.
    Either way the full blocks are found: the same chunk of new
    tokens follows them."""
    config = EngineConfig(model=model, cache=CacheConfig(64 << 20), tier=TierConfig("memory"))
    engine = LLMEngine(config, smollm)  # the default cost model: it must choose to load
    try:
        history = smollm.tokenizer.encode(ESSAY[:1500])
        engine.add_request(EngineRequest(history, GREEDY, "t1", session_id="s"))
        reply = run(engine)["t1"].token_ids
        history += reply + smollm.tokenizer.encode(" In short,")
        engine.offload.flush()
        engine.release_session("s")  # the pin is gone; the full blocks stay in the pool
        if via_tier:
            forget_pool(engine)  # and now only the tier has them
        engine.add_request(EngineRequest(history, GREEDY, "t2", session_id="s"))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        cached = (len(history) - 4) // 16 * 16  # all but " In short,"
        assert outputs[-1].cached_tokens == cached
        assert outputs[-1].tier_cached_tokens == (cached if via_tier else 0)
        second = [t for o in outputs for t in o.new_token_ids]
        if via_tier and model.dtype == "float32":
            engine.add(
                engine.make_request(EngineRequest(history, GREEDY, "t3", use_prefix_cache=False))
            )
            assert run(engine)["t3"].token_ids == second  # fp32: restored = recomputed
        return second
    finally:
        engine.close()


def test_fp32_reply_after_a_tier_restore_equals_the_recomputed_reply(smollm):
    _second_turn(smollm, ModelConfig(quantization="none", dtype="float32"), via_tier=True)


def test_default_format_reply_after_a_tier_restore_equals_the_pool_hit_reply(smollm):
    """With bf16 activations a recomputed history rounds differently from one decoded
    token by token (docs/determinism.md); what a restore must give is what the pool
    would have: the same K/V, bit for bit."""
    restored = _second_turn(smollm, ModelConfig(), via_tier=True)
    assert restored == _second_turn(smollm, ModelConfig(), via_tier=False)


def ws_turn(url: str, conversation: str, messages: list[dict]) -> dict:
    """One /ws turn: its start frame, reply text and done frame."""
    with connect(url.replace("http", "ws") + "/ws") as ws:
        ws.send(json.dumps({"type": "chat", "id": "t", "conversation_id": conversation,
                            "messages": messages,
                            "params": {"temperature": 0, "max_tokens": 24}}))  # fmt: skip
        out = {"text": ""}
        while True:
            frame = json.loads(ws.recv(timeout=300))
            if frame["type"] == "token":
                out["text"] += frame["text"]
            elif frame["type"] in ("start", "done", "error"):
                out[frame["type"]] = frame
                if frame["type"] != "start":
                    return out


def test_the_next_turn_on_another_server_gets_its_kv_from_redis(smollm):
    redis_or_skip()
    server = RedisServer().start()  # its own: nobody else's entries
    config = EngineConfig(cache=CacheConfig(128 << 20), tier=TierConfig("redis", server.url))
    first, second = (AsyncEngine(LLMEngine(config, smollm)) for _ in range(2))
    try:
        with (
            live_server(create_app(engine=first)) as a,
            live_server(create_app(engine=second)) as b,
        ):
            messages = [
                {"role": "system", "content": "You answer questions about this text.\n" + ESSAY},
                {"role": "user", "content": "What is the text about?"},
            ]
            one = ws_turn(a.url, "c1", messages)
            assert one["start"]["tier_cached_tokens"] == 0
            assert first.engine.offload.flush()  # written to Redis in the background
            messages += [
                {"role": "assistant", "content": one["text"]},
                {"role": "user", "content": "Say it in one word."},
            ]
            two = ws_turn(b.url, "c1", messages)
            start, done = two["start"], two["done"]
            # The second server re-tokenizes the reply, so reuse may stop where it starts,
            # but never before: all of turn 1's prompt comes from Redis.
            assert start["tier_cached_tokens"] >= one["start"]["prompt_tokens"] // 16 * 16
            assert start["tier_cached_tokens"] == start["cached_tokens"]
            assert done["usage"]["tier_cached_tokens"] == start["tier_cached_tokens"]
            metrics = httpx.get(b.url + "/metrics").text
            assert "parley:kv_tier_hits_total" in metrics
            hits = next(line for line in metrics.splitlines()
                        if line.startswith("parley:kv_tier_hits_total"))  # fmt: skip
            assert float(hits.split()[1]) == start["tier_cached_tokens"] // 16
    finally:
        server.close()


def test_ready_and_serving_while_redis_is_unreachable(tokenizer):
    redis_or_skip()
    server = RedisServer()  # never started: nothing listens on its port
    tier = TierConfig("redis", server.url, timeout_s=0.2, min_load_speedup=0)
    engine = AsyncEngine(tiny_engine(tokenizer, tier=tier))
    with TestClient(create_app(engine=engine, server_config=for_testclient())) as client:
        assert client.get("/ready").status_code == 200
        r = client.post("/v1/completions", json={"prompt": "Hello there, " * 20,
                                                 "max_tokens": 5, "ignore_eos": True})  # fmt: skip
        assert r.status_code == 200
        details = r.json()["usage"]["prompt_tokens_details"]
        assert details == {"cached_tokens": 0, "tier_cached_tokens": 0}
        metrics = client.get("/metrics").text
        assert "parley:kv_tier_up 0.0" in metrics
        assert 'parley:kv_tier_info{backend="redis://127.0.0.1:' in metrics
        assert client.get("/ready").status_code == 200
