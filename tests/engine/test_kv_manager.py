"""KVCacheManager alone: block tables, prefix lookups, salts, pins; no model."""

from app.engine.block_pool import BlockPool
from app.engine.kv_manager import KVCacheManager
from app.engine.request import Request, SamplingParams

BS = 4


def request(rid: str, tokens: list[int], session=None, salt=None) -> Request:
    return Request(rid, tokens, SamplingParams(), 8, session_id=session, cache_salt=salt)


def compute(kv: KVCacheManager, req: Request) -> None:
    """Allocate and "compute" the whole prompt, registering its full blocks."""
    computed = kv.get_computed(req)
    assert kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(BlockPool(4), BS)  # 3 usable blocks
    big = request("big", list(range(20)))
    assert not kv.allocate_slots(big, 20)  # needs 5 blocks
    assert kv.block_ids("big") == [] and kv.pool.num_free_blocks == 3
    small = request("small", list(range(9)))
    assert kv.allocate_slots(small, 9) and len(kv.block_ids("small")) == 3
    kv.check_integrity()


def test_the_prefix_cache_finds_full_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(BlockPool(16), BS)
    first = request("a", list(range(12)))
    compute(kv, first)
    kv.free(first)
    again = kv.get_computed(request("b", list(range(12))))
    assert again.num_tokens == 8  # the last block holds the token whose logits we need
    longer = kv.get_computed(request("c", [*range(12), 99]))
    assert longer.num_tokens == 12 and not longer.from_pin
    other = kv.get_computed(request("d", [5, *range(1, 12)]))
    assert other.num_tokens == 0  # a different first block: a different chain


def test_different_salts_never_share_blocks():
    kv = KVCacheManager(BlockPool(16), BS)
    compute(kv, request("a", list(range(13)), salt="acme"))
    assert kv.get_computed(request("b", list(range(13)), salt="acme")).num_tokens == 12
    assert kv.get_computed(request("c", list(range(13)), salt="globex")).num_tokens == 0
    assert kv.get_computed(request("d", list(range(13)))).num_tokens == 0


def test_a_session_pin_covers_more_than_the_cache_to_the_token():
    kv = KVCacheManager(BlockPool(16), BS)
    turn = request("t1", list(range(10)), session="s")
    compute(kv, turn)
    kv.free_or_pin(turn)  # 10 tokens pinned, the partial third block included
    assert kv.pins.pinned_tokens("s") == list(range(10))
    nxt = kv.get_computed(request("t2", [*range(10), 50, 51], session="s"))
    assert nxt.from_pin and nxt.num_tokens == 10
    kv.check_integrity()


def test_a_computed_prefix_ends_where_its_last_window_is_whole():
    """With a 40-position window and blocks of 16: the longest prefix of at most n tokens
    whose last 40 positions lie in blocks not given back (windowed)."""
    kv = KVCacheManager(BlockPool(8), 16, window=40)
    T, F = True, False
    assert kv._whole_window([T, T, T, F, F, F, F], 112) == 112  # 73-111: blocks 4-6
    assert kv._whole_window([T, T, T, F, F], 80) == 0  # 41-79 reach block 2; 32 reach 0-1
    assert kv._whole_window([F, F, T, F], 64) == 32  # before block 2: 0-31 whole
    assert kv._whole_window([F, F, T, F, F, F], 96) == 96  # 57-95: blocks 3-5
    assert kv._whole_window([T, T], 0) == 0
    assert KVCacheManager(BlockPool(8), 16)._whole_window([T, T], 32) == 32  # no window
