"""The KV tier under a tiny engine: a conversation that lost its pinned K/V gets it back
from the tier (counted as cached, and apart), and nothing wrong in the tier ever changes a
token."""

import logging
import random
import time

import pytest

from app.config import TierConfig
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.kvtier.entry import encode
from tests.engine.util import run
from tests.redis_server import RedisServer, redis_or_skip
from tests.tiny import tiny_engine

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MEMORY = TierConfig("memory", min_load_speedup=0)  # tiny steps are too fast to beat: load


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture
def engines():
    made = []

    def make(tokenizer, **kw):
        made.append(tiny_engine(tokenizer, **kw))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def turn(engine, rid, prompt, session="s", params=PARAMS):
    """One request to its end: (token ids, cached tokens, tier tokens)."""
    engine.add_request(EngineRequest(prompt, params, rid, session_id=session))
    cached = tier = 0
    ids = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            cached, tier = out.cached_tokens, out.tier_cached_tokens
        engine.check_integrity()
    return ids, cached, tier


def recomputed(tokenizer, prompt, params=PARAMS):
    engine = tiny_engine(tokenizer, prefix_caching=False)
    engine.add_request(EngineRequest(prompt, params, "x"))
    return run(engine)["x"].token_ids


def forget_pool(engine) -> None:
    """Every free block's memory reused: the pool's prefix cache forgets it all."""
    pool = engine.kv.pool
    pool.free(pool.allocate(pool.num_free_blocks))


def lose_pin(engine, session="s") -> None:
    engine.offload.flush()
    engine.release_session(session)
    forget_pool(engine)


def test_a_lost_pin_comes_back_from_the_tier_and_the_reply_is_the_same(tokenizer, engines):
    engine = engines(tokenizer, num_blocks=64, tier=MEMORY)
    history = tokens(150, 0)
    reply, cached, tier = turn(engine, "t1", history)
    assert cached == 0 and tier == 0
    history += reply + tokens(20, 1)
    lose_pin(engine)
    reply2, cached, tier = turn(engine, "t2", history)
    # Every full block of turn 1 (prompt and reply but the last token) from the tier.
    assert tier == cached == (150 + 12 - 1) // 16 * 16
    assert reply2 == recomputed(tokenizer, history)
    s = engine.stats()
    assert s.tier_hits == tier and s.tier.hits == tier // 16 and s.prefix_hits == 0
    assert s.tier.stores >= 10 and s.tier.errors == {}


def test_pool_pins_and_tier_are_counted_apart(tokenizer, engines):
    engine = engines(tokenizer, num_blocks=64, tier=MEMORY)
    history = tokens(100, 0)
    reply, _, _ = turn(engine, "t1", history)
    history += reply + tokens(10, 1)
    _, cached, tier = turn(engine, "t2", history)  # pin still there: not the tier
    assert cached > 0 and tier == 0
    assert engine.stats().tier.hits == 0


def test_real_pressure_sends_blocks_to_the_tier_and_back(tokenizer, engines):
    """A small pool and three conversations: each next turn finds its K/V in the tier."""
    for store in ("finish", "evict"):
        engine = engines(
            tokenizer, num_blocks=24, tier=TierConfig("memory", store=store, min_load_speedup=0)
        )
        histories = {s: tokens(120, i) for i, s in enumerate("abc")}
        from_tier = 0
        for round_ in range(2):
            for s in "abc":
                reply, cached, tier = turn(engine, f"{s}{round_}", histories[s], session=s)
                if round_:  # every full block of turn 1 is back, from the pool or the tier
                    assert cached == (120 + 12 - 1) // 16 * 16, (store, s, cached, tier)
                    assert reply == recomputed(tokenizer, histories[s])
                    from_tier += tier
                histories[s] = histories[s] + reply + tokens(8, round_ + 10)
                engine.offload.flush()
        assert from_tier >= 128, store  # 23 blocks cannot hold three conversations of 9
        assert engine.stats().session_unpins["pressure"] >= 2


def test_corrupt_truncated_and_foreign_entries_mean_recompute(tokenizer, engines, caplog):
    engine = engines(tokenizer, num_blocks=64, tier=MEMORY)
    tier = engine.offload.tier
    history = tokens(100, 0)
    reply, _, _ = turn(engine, "t1", history)
    lose_pin(engine)
    keys = list(tier._entries)  # oldest first: the chain's first blocks
    assert len(keys) == 6
    good = tier.get_many(keys)
    foreign = engine.offload.layout.__class__(b"x" * 16, engine.offload.layout.dtype,
                                              engine.offload.layout.shape)  # fmt: skip
    bad = {
        "checksum": good[2][:-5] + bytes([good[2][-5] ^ 1]) + good[2][-4:],
        "truncated": good[2][:-1],
        "foreign": encode(foreign, keys[0], engine.kv_cache.tensor[:, :, 1].clone()),
    }
    caplog.set_level(logging.WARNING, logger="parley.kvtier")
    for i, (reason, entry) in enumerate(bad.items()):
        tier.put_many([(k, e) for k, e in zip(keys, good)])
        tier.put_many([(keys[2], entry)])  # the third block of the chain is bad
        engine.release_session("s")
        forget_pool(engine)
        prompt = history + reply + tokens(5, i + 1)
        ids, cached, tier_tokens = turn(engine, f"r{i}", prompt)
        assert tier_tokens == cached == 2 * 16, reason  # the good blocks before it
        assert ids == recomputed(tokenizer, prompt), reason
        assert engine.stats().tier.errors[reason] == 1
        engine.offload.flush()  # the recomputed block replaced the bad entry
        assert tier.get_many([keys[2]])[0] not in (None, entry)
    assert caplog.text.count("recomputing instead") == 3  # one line per reason


def test_cache_false_keeps_nothing_in_the_tier(tokenizer, engines):
    engine = engines(tokenizer, num_blocks=64, tier=MEMORY)
    engine.add(
        engine.make_request(EngineRequest(tokens(100, 0), PARAMS, "x", use_prefix_cache=False))
    )
    run(engine)
    engine.offload.flush()
    assert engine.stats().tier.stores == 0 and engine.offload.tier.usage().blocks == 0


def test_a_load_slower_than_recompute_is_not_made(tokenizer, engines):
    engine = engines(tokenizer, num_blocks=64, tier=TierConfig("memory", min_load_speedup=1e9))
    history = tokens(100, 0)
    reply, _, _ = turn(engine, "t1", history)
    lose_pin(engine)
    _, cached, tier = turn(engine, "t2", history + reply + [7])
    assert cached == tier == 0
    s = engine.stats().tier
    assert s.loads_skipped >= 1 and s.hits == 0


def test_other_weights_never_see_the_entries(tokenizer, redis_server, engines):
    config = TierConfig("redis", redis_server.url, min_load_speedup=0)
    first = engines(tokenizer, num_blocks=64, tier=config, seed=0)
    history = tokens(100, 123)
    reply, _, _ = turn(first, "t1", history, session=None)
    first.offload.flush()
    other = engines(tokenizer, num_blocks=64, tier=config, seed=1)  # other weights
    _, cached, _ = turn(other, "t1", history + reply, session=None)
    assert cached == 0 and other.stats().tier.errors == {}
    same = engines(tokenizer, num_blocks=64, tier=config, seed=0)  # another process, same model
    ids, cached, tier = turn(same, "t1", history + reply + [9], session=None)
    assert tier == cached == 96  # what the first computed: 111 tokens, 6 full blocks
    assert ids == recomputed(tokenizer, history + reply + [9])


def test_redis_killed_mid_run_then_back(tokenizer, engines, monkeypatch, caplog):
    """The engine keeps serving while Redis is gone, and uses it again once it is back."""
    redis_or_skip()
    from app.kvtier import redis as redis_tier

    monkeypatch.setattr(redis_tier, "PROBE_EVERY_S", (0.1, 0.2))
    server = RedisServer().start()
    caplog.set_level(logging.WARNING, logger="parley.kvtier")
    try:
        config = TierConfig("redis", server.url, timeout_s=0.3, min_load_speedup=0)
        engine = engines(tokenizer, num_blocks=64, tier=config)
        history = tokens(100, 0)
        reply, _, _ = turn(engine, "t1", history)
        history += reply + [5]
        lose_pin(engine)
        server.stop()
        for i in range(3):  # served without the tier
            ids, cached, tier = turn(engine, f"down{i}", history, session=None)
            assert tier == 0 and ids == recomputed(tokenizer, history)
            forget_pool(engine)
        s = engine.stats().tier
        assert not s.available and s.errors.get("unreachable", 0) >= 1
        assert caplog.text.count("unreachable") == 1
        server.start()
        deadline = time.monotonic() + 15
        while not engine.stats().tier.available:  # the store worker's probe reconnects
            assert time.monotonic() < deadline, "the tier did not come back"
            time.sleep(0.1)
            engine.step()
        assert "reachable again" in caplog.text
        reply, _, _ = turn(engine, "up1", history, session="u")  # stored again ...
        lose_pin(engine, "u")
        _, cached, tier = turn(engine, "up2", history + reply + [6], session="u")
        assert tier == cached > 0  # ... and loaded again
    finally:
        server.close()


def test_redis_unreachable_at_start_serves_without_it(tokenizer, engines):
    redis_or_skip()
    server = RedisServer()  # never started
    config = TierConfig("redis", server.url, timeout_s=0.2, min_load_speedup=0)
    engine = engines(tokenizer, num_blocks=64, tier=config)
    history = tokens(60, 0)
    ids, _, _ = turn(engine, "t1", history)
    assert ids == recomputed(tokenizer, history)
    s = engine.stats().tier
    assert not s.available and s.stores == 0 and s.stores_dropped > 0
