"""The router's decisions as pure logic (no Ray): conversation affinity bounded by load,
and, for requests without a key, the longest cached prefix the replicas published."""

from app.cluster.router import (
    AFFINE,
    BALANCED,
    PREFIX,
    REBALANCED,
    Router,
    prompt_block_hashes,
)
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from tests.tiny import tiny_engine

BS = 16
SYSTEM = list(range(1000, 1000 + 4 * BS))  # a shared system prompt: 4 blocks


def hashes(ids, salt=None):
    return prompt_block_hashes(ids, salt, BS)


def test_a_prompt_goes_to_the_replica_holding_its_longest_prefix():
    r = Router(threshold=4, min_prefix_blocks=2)
    prompt = SYSTEM + list(range(5000, 5000 + 2 * BS))
    r.publish(0, hashes(SYSTEM[: 2 * BS]))
    r.publish(1, hashes(prompt[: 5 * BS]))
    r.publish(2, [])
    assert r.matched_blocks(0, hashes(prompt)) == 2
    assert r.matched_blocks(1, hashes(prompt)) == 5
    assert r.pick_by_prefix(hashes(prompt), {0: 0, 1: 2, 2: 0}) == (1, PREFIX)
    assert r.decisions[PREFIX] == 1


def test_a_short_match_falls_back_to_the_least_loaded():
    r = Router(threshold=4, min_prefix_blocks=2)
    r.publish(0, hashes(SYSTEM[:BS]))  # one block: a chat template's start says little
    assert r.pick_by_prefix(hashes(SYSTEM), {0: 1, 1: 0}) == (1, BALANCED)


def test_a_busy_holder_is_passed_over():
    r = Router(threshold=2, min_prefix_blocks=2)
    r.publish(0, hashes(SYSTEM))
    assert r.pick_by_prefix(hashes(SYSTEM), {0: 2, 1: 0}) == (0, PREFIX)  # within the bound
    assert r.pick_by_prefix(hashes(SYSTEM), {0: 3, 1: 0}) == (1, BALANCED)  # past it
    # The spilled request's blocks now count on replica 1 too: equal match, less loaded.
    assert r.pick_by_prefix(hashes(SYSTEM), {0: 1, 1: 0}) == (1, PREFIX)


def test_hashes_are_chained_so_only_a_leading_run_matches():
    r = Router(min_prefix_blocks=1)
    h = hashes(SYSTEM)
    r.publish(0, h[1:])  # holds blocks 2..4 but not the first: nothing usable
    assert r.matched_blocks(0, h) == 0
    other_start = hashes([7] * BS + SYSTEM[BS:])
    r.publish(1, h)
    assert r.matched_blocks(1, other_start) == 0  # same later tokens, another first block


def test_a_salt_never_matches_another_salts_blocks():
    r = Router(min_prefix_blocks=1)
    r.publish(0, hashes(SYSTEM, salt="tenant-a"))
    assert r.matched_blocks(0, hashes(SYSTEM, salt="tenant-a")) == 4
    assert r.matched_blocks(0, hashes(SYSTEM, salt="tenant-b")) == 0
    assert r.matched_blocks(0, hashes(SYSTEM)) == 0


def test_a_burst_sharing_a_prompt_follows_the_first_before_any_heartbeat():
    r = Router(threshold=4, min_prefix_blocks=2)
    first = r.pick_by_prefix(hashes(SYSTEM), {0: 0, 1: 0, 2: 0})
    assert first == (0, BALANCED)  # nothing known yet: least loaded
    loads = {0: 1, 1: 0, 2: 0}
    for _ in range(3):
        replica, decision = r.pick_by_prefix(hashes(SYSTEM + [1, 2, 3]), loads)
        assert (replica, decision) == (0, PREFIX)
        loads[0] += 1
    # Past the load bound the burst spills over, and the spill is remembered too.
    assert r.pick_by_prefix(hashes(SYSTEM), {0: 5, 1: 0, 2: 0}) == (1, BALANCED)
    assert r.matched_blocks(1, hashes(SYSTEM)) == 4


def test_a_heartbeat_replaces_what_was_known_and_a_lost_replica_holds_nothing():
    r = Router(min_prefix_blocks=1)
    r.pick_by_prefix(hashes(SYSTEM), {0: 0})
    assert r.matched_blocks(0, hashes(SYSTEM)) == 4
    r.publish(0, hashes(SYSTEM[: 2 * BS]))  # its pool let the rest go
    assert r.matched_blocks(0, hashes(SYSTEM)) == 2
    r.drop(0)
    assert r.matched_blocks(0, hashes(SYSTEM)) == 0


def test_keys_stick_to_their_home_within_the_load_bound():
    r = Router(threshold=1)
    home, decision = r.pick("conv", {0: 0, 1: 0})
    assert decision == AFFINE
    assert r.pick("conv", {home: 1, 1 - home: 0}) == (home, AFFINE)
    assert r.pick("conv", {home: 2, 1 - home: 0}) == (1 - home, REBALANCED)
    assert r.pick("conv", {0: 0, 1: 0}) == (1 - home, AFFINE)  # its new home
    assert r.pick("conv", {home: 0}) == (home, REBALANCED)  # its home is gone


def test_no_live_replica_is_an_error():
    r = Router()
    for pick in (lambda: r.pick("k", {}), lambda: r.pick_by_prefix([], {})):
        try:
            pick()
        except ValueError:
            continue
        raise AssertionError("routed to no replica")


def test_the_front_names_blocks_as_the_engine_caches_them(tokenizer):
    """The front hashes a prompt itself: its names must be the engine's, salt and all,
    or no prefix would ever match."""
    engine = tiny_engine(tokenizer, block_size=BS)
    prompt = list(range(100, 100 + 3 * BS + 5))
    for salt in (None, "tenant"):
        params = SamplingParams(max_tokens=1)
        engine.add(engine.make_request(EngineRequest(prompt, params, cache_salt=salt)))
        while engine.has_unfinished_requests():
            engine.step()
        published = set(engine.kv.pool.cached_hashes(1024))
        assert set(hashes(prompt, salt)) <= published
    assert engine.kv.pool.cached_hashes(2) == list(engine.kv.pool._cached)[-2:]
