"""Local layers give back the K/V that fell out of their window (KVCache.release_local,
KVCacheManager.release_behind_window), on a small random Gemma 3 (5 layers over the last 8
positions, then a global one) in the exact format.

Under the engine's debug checks a released block's local-layer K/V reads as 1e4 instead of
zeros, so that a kernel, or a computed prefix, that used it would change the reply: the
replies are compared with an engine that keeps everything. The last test shows that the
comparison can fail."""

import pytest

from app.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    TierConfig,
    default_cache_dir,
)
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.kv_manager import KVCacheManager
from app.engine.request import SamplingParams
from app.model import kernels
from app.model.loader import load_model
from app.model.registry import default_model_path
from tests.engine.util import run
from tests.model.gguf_families import tiny_hf, write_family_gguf

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG = [1000 + (i * 37) % 500 for i in range(100)]  # 100 tokens: 12 windows' worth


@pytest.fixture(scope="module", params=["on", "off"], ids=["kernels", "pytorch"])
def gemma(request, tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("gemma")
    source = default_model_path(default_cache_dir())  # its tokenizer
    path = write_family_gguf(tiny_hf("gemma3", len(tokenizer)), folder / "g.gguf", source)
    if request.param == "on":  # the build every test shares, not one in this folder
        kernels.load(default_cache_dir())
    cfg = ModelConfig(model=str(path), cache_dir=folder / "cache", quantization="none",
                      dtype="float32", cpu_kernels=request.param)  # fmt: skip
    return cfg, load_model(cfg)


def engine(
    gemma,
    release: bool = True,
    chunk: int = 32,
    debug: bool = True,
    tier: bool = False,
    cache_bytes: int = 8 << 20,
) -> LLMEngine:
    cfg, loaded = gemma
    cache = CacheConfig(cache_bytes, release_out_of_window=release)
    sched = SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=8)
    # min_load_speedup 0: the tiny model computes faster than the tier would be worth
    kv_tier = TierConfig("memory", min_load_speedup=0) if tier else TierConfig("none")
    return LLMEngine(EngineConfig(cfg, cache, sched, debug_checks=debug, tier=kv_tier), loaded)


def reply(eng: LLMEngine, prompt, session: str | None = None, rid: str = "r"):
    eng.add_request(EngineRequest(list(prompt), GREEDY, rid, session_id=session))
    return run(eng)[rid]


def test_a_long_prompt_and_reply_give_back_what_left_the_window(gemma):
    kept, released = engine(gemma, release=False), engine(gemma)
    assert released.kv.window == kept.kv.window == 8 and kept.kv._release is None
    want = reply(kept, LONG).token_ids
    assert reply(released, LONG).token_ids == want  # chunks of 32, then 24 decodes
    # 123 positions computed (the last token is only sampled): the next query, at 123,
    # attends to 116-123, so blocks 0-6 (positions 0-111) are out of every later window;
    # one block is kept beside it for a prompt that goes on from here (by whole blocks).
    assert released.kv.pool.num_windowed == 6
    assert kept.kv.pool.num_windowed == 0


def test_the_memory_given_back_shows_in_the_resident_bytes(gemma):
    """Without debug checks a release gives memory back (zeros after), and /metrics'
    resident K/V says so: here 4 KiB of each of the 5 local layers' K and V a block."""
    kept, released = engine(gemma, release=False, debug=False), engine(gemma, debug=False)
    assert reply(released, LONG).token_ids == reply(kept, LONG).token_ids
    cache = released.kv_cache
    assert cache.bytes_per_block - cache.windowed_bytes_per_block == 5 * 2 * 4096
    less = kept.stats().kv_resident_bytes - released.stats().kv_resident_bytes
    assert less == 6 * 5 * 2 * 4096


def test_the_memory_given_back_holds_more_conversations(gemma):
    """Memory for 19 blocks of 16 tokens; four requests of 124 tokens need 8 blocks each.
    Keeping everything, they take turns (preemptions); giving back what left the window
    (5 of a block's 6 layers), all four run at once, in more blocks than the memory holds
    full, and what is written stays within the memory asked for (BlockPool's
    check_integrity, every step). The replies are the same either way."""
    per_block = engine(gemma).kv_cache.bytes_per_block
    kept, released = (engine(gemma, r, cache_bytes=20 * per_block) for r in (False, True))
    assert kept.kv.pool.num_blocks == released.kv.pool.num_blocks == 19
    assert (kept.kv_cache.num_blocks, released.kv_cache.num_blocks) == (20, 6 * 20)
    prompts = [LONG[i:] + LONG[:i] for i in (0, 25, 50, 75)]
    replies, peaks = [], []
    for eng in (kept, released):
        for i, p in enumerate(prompts):
            eng.add_request(EngineRequest(p, GREEDY, str(i)))
        pool, held = eng.kv.pool, [0]

        def count(_, pool=pool, held=held):
            held[0] = max(held[0], sum(b.ref_count > 0 for b in pool.blocks[1:]))

        got = run(eng, before_step=count)
        replies.append([got[str(i)].token_ids for i in range(4)])
        peaks.append(held[0])
    assert replies[0] == replies[1]
    assert kept.stats().num_preemptions > 0 and peaks[0] <= 19
    assert released.stats().num_preemptions == 0 and peaks[1] > 19
    assert released.stats().kv_resident_bytes <= 20 * per_block


def test_batched_replies_release_and_keep_their_bits(gemma):
    prompts = [LONG, LONG[10:90], LONG[::-1]]
    kept, released = engine(gemma, release=False), engine(gemma)
    for eng in (kept, released):
        for i, p in enumerate(prompts):
            eng.add_request(EngineRequest(p, GREEDY, str(i)))
    want, got = run(kept), run(released)
    assert [got[str(i)].token_ids for i in range(3)] == [want[str(i)].token_ids for i in range(3)]
    assert released.kv.pool.num_windowed > 0


def test_a_prefix_whose_window_was_given_back_is_computed_again(gemma):
    """A prompt sharing the first 60 tokens of a long one finds them in the prefix cache,
    but their last window's local K/V is gone: it starts before that window instead."""
    kept, released = engine(gemma, release=False), engine(gemma)
    other = LONG[:60] + [7, 8, 9]
    for eng in (kept, released):
        reply(eng, LONG, rid="long")
    want = reply(kept, other, rid="other")
    got = reply(released, other, rid="other")
    assert got.token_ids == want.token_ids
    assert want.cached_tokens == 48 and got.cached_tokens < 48


def test_the_next_turn_of_a_conversation_loses_nothing(gemma):
    """A conversation goes on from its end, whose window is whole: its pin (and the prefix
    cache) still give the whole history."""
    kept, released = engine(gemma, release=False), engine(gemma)
    first = {eng: reply(eng, LONG, "s", "t1") for eng in (kept, released)}
    assert first[kept].token_ids == first[released].token_ids
    follow = LONG + first[kept].token_ids + [11, 12, 13]
    want = reply(kept, follow, "s", "t2")
    got = reply(released, follow, "s", "t2")
    assert got.token_ids == want.token_ids
    assert got.cached_tokens == want.cached_tokens == len(LONG) + 24 - 1
    # Without a session, the next turn from the prefix cache (by whole blocks): the same.
    after = follow + want.token_ids + [14, 15]
    plain = [reply(eng, after, rid="t3") for eng in (kept, released)]
    assert plain[0].token_ids == plain[1].token_ids
    assert plain[1].cached_tokens == plain[0].cached_tokens == 144


def test_the_comparison_can_fail(gemma, monkeypatch):
    """A computed prefix taken whole, its released window and all, changes the reply."""
    kept, released = engine(gemma, release=False), engine(gemma)
    other = LONG[:60] + [7, 8, 9]
    for eng in (kept, released):
        reply(eng, LONG, rid="long")
    monkeypatch.setattr(KVCacheManager, "_whole_window", lambda self, blocks, n: n)
    got = reply(released, other, rid="other")
    assert got.cached_tokens == 48
    assert got.token_ids != reply(kept, other, rid="other").token_ids


def test_an_edited_turn_whose_pin_lost_its_window_starts_before_it(gemma):
    """A next turn that changes the history at token 70 shares 64 tokens (whole blocks:
    the 5th is in the prefix cache) with the pin, whose last window was given back: it is
    computed again from a point before that window (here the start: every block before
    it was given back too), and its reply is the kept engine's."""
    kept, released = engine(gemma, release=False), engine(gemma)
    for eng in (kept, released):
        reply(eng, LONG, "s", "t1")
    edited = LONG[:70] + [5, 6, 7, 8]
    want = reply(kept, edited, "s", "t2")
    got = reply(released, edited, "s", "t2")
    assert got.token_ids == want.token_ids
    assert want.cached_tokens == 64 and got.cached_tokens == 0


def lose_pool(eng: LLMEngine, session: str) -> None:
    """The session's pin dropped and every free block's memory reused: only the tier
    still has the conversation's K/V."""
    eng.offload.flush()
    eng.release_session(session)
    pool = eng.kv.pool
    pool.free(pool.allocate(pool.num_free_blocks))


def test_the_tier_keeps_which_blocks_were_windowed(gemma):
    """Blocks given back are stored in the KV tier as they are, flagged: a next turn
    from the tier reuses the whole history (its last window is whole), and a prompt that
    ends inside the given-back part starts before it, as from the pool."""
    kept, released = engine(gemma, release=False, tier=True), engine(gemma, tier=True)
    first = {eng: reply(eng, LONG, "s", "t1") for eng in (kept, released)}
    follow = LONG + first[kept].token_ids + [11, 12, 13]
    other = LONG[:60] + [7, 8, 9]
    for eng in (kept, released):
        lose_pool(eng, "s")
    want, got = reply(kept, follow, "s", "t2"), reply(released, follow, "s", "t2")
    assert got.token_ids == want.token_ids and got.cached_tokens == want.cached_tokens == 112
    assert released.stats().tier_hits == 112
    assert released.kv.pool.num_windowed >= 6  # restored as they were stored
    for eng in (kept, released):
        lose_pool(eng, "s")
    want, got = reply(kept, other, rid="o"), reply(released, other, rid="o")
    assert got.token_ids == want.token_ids
    assert want.cached_tokens == 48 and got.cached_tokens == 0
