"""The router alone (no Ray), by key: affinity first, a load bound second, stable homes."""

import pytest

from app.cluster import router as router_module
from app.cluster.router import AFFINE, BALANCED, REBALANCED, Router, rendezvous


def test_a_key_goes_home_while_its_home_is_not_much_busier():
    r = Router(threshold=2)
    home, why = r.pick("conv", {0: 0, 1: 0, 2: 0})
    assert why == AFFINE  # a first visit: its rendezvous home
    loads = {0: 0, 1: 0, 2: 0}
    loads[home] = 2  # busier by the threshold: still home
    assert r.pick("conv", loads) == (home, AFFINE)


def test_a_home_busier_than_the_threshold_loses_the_key_to_the_least_loaded():
    r = Router(threshold=2)
    home, _ = r.pick("conv", {0: 0, 1: 0})
    other = 1 - home
    moved, why = r.pick("conv", {home: 3, other: 0})
    assert (moved, why) == (other, REBALANCED)
    # The new home keeps it from now on, even once the old one is idle again.
    assert r.pick("conv", {home: 0, other: 1}) == (other, AFFINE)
    assert r.decisions == {AFFINE: 2, REBALANCED: 1}


def test_no_key_goes_to_the_least_loaded_lowest_first_on_a_tie():
    r = Router()
    assert r.pick(None, {0: 3, 1: 1, 2: 1}) == (1, BALANCED)
    assert r.pick(None, {2: 0, 0: 0}) == (0, BALANCED)


def test_a_dead_home_sends_the_key_to_the_least_loaded_live_replica():
    r = Router(threshold=4)
    home, _ = r.pick("conv", {0: 0, 1: 0, 2: 0})
    live = {i: 0 for i in range(3) if i != home}
    live[min(live)] = 1
    replica, why = r.pick("conv", live)
    assert why == REBALANCED and replica == max(live)  # the least loaded of the live ones


def test_no_live_replica_is_an_error():
    with pytest.raises(ValueError, match="no live replica"):
        Router().pick("conv", {})


def test_forget_lets_a_key_find_its_rendezvous_home_again():
    r = Router(threshold=0)
    first, _ = r.pick("conv", {0: 0, 1: 0})
    r.pick("conv", {first: 5, 1 - first: 0})  # moved away
    r.forget("conv")
    assert r.pick("conv", {0: 0, 1: 0}) == (first, AFFINE)
    r.forget("never seen")  # harmless


def test_rendezvous_spreads_keys_and_moves_only_a_lost_replicas_keys():
    keys = [f"k{i}" for i in range(400)]
    homes = {k: rendezvous(k, [0, 1, 2, 3]) for k in keys}
    counts = [list(homes.values()).count(i) for i in range(4)]
    assert min(counts) > 60  # about 100 each
    after = {k: rendezvous(k, [0, 1, 3]) for k in keys}  # replica 2 gone
    assert all(after[k] == homes[k] for k in keys if homes[k] != 2)
    assert rendezvous("k1", [3, 1, 0]) == rendezvous("k1", [0, 1, 3])  # order does not matter


def test_homes_are_bounded_least_recently_used_out(monkeypatch):
    monkeypatch.setattr(router_module, "MAX_HOMES", 2)
    r = Router(threshold=0)
    for key in ("a", "b"):
        r.pick(key, {0: 0, 1: 0})
    r.pick("a", {0: 0, 1: 0})  # a is recent again
    r.pick("c", {0: 0, 1: 0})  # b, the least recent, is let go
    assert set(r._homes) == {"a", "c"}
