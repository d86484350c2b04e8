"""bench/ttft_floor.py: the TTFT floor the adaptive-batching bench compares against is
never above what an actual order achieves, and is tight where it should be."""

import itertools
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from ttft_floor import fifo_max_flow, quantile, ttft_floors


def flows_in_order(arrivals, work, order):
    """Each request's completion - arrival when served whole, in `order`, as soon as it
    has arrived and the one before it is done."""
    clock, flows = 0.0, [0.0] * len(work)
    for i in order:
        clock = max(clock, arrivals[i]) + work[i]
        flows[i] = clock - arrivals[i]
    return flows


def test_quantile_is_numpys():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 5, 56, 87, 150):
        xs = [rng.random() for _ in range(n)]
        for q in (0.5, 0.9, 0.99):
            assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))


def test_no_order_beats_the_floor():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(2, 6)
        arrivals = sorted(rng.uniform(0, 3) for _ in range(n))
        work = [rng.uniform(0.05, 2.0) for _ in range(n)]
        best_max = min(
            max(flows_in_order(arrivals, work, order)) for order in itertools.permutations(range(n))
        )
        assert fifo_max_flow(arrivals, work) == pytest.approx(best_max)
        floors = ttft_floors(arrivals, work, latency=0.01)
        for order in itertools.permutations(range(n)):
            flows = sorted(f + 0.01 for f in flows_in_order(arrivals, work, order))
            assert all(lo <= f + 1e-9 for lo, f in zip(floors, flows))
            for q in (0.5, 0.99):
                assert quantile(floors, q) <= quantile(flows, q) + 1e-9


def test_the_floor_is_tight_for_a_burst_and_pointwise_when_apart():
    # Three prompts at once: whichever goes last waits for all three.
    assert ttft_floors([0.0, 0.0, 0.0], [1.0, 1.0, 1.0]) == pytest.approx([1.0, 2.0, 3.0])
    # Far apart, nobody waits: the floor is each one alone.
    apart = ttft_floors([0.0, 10.0, 20.0], [1.0, 2.0, 0.5], latency=0.1)
    assert apart == pytest.approx([0.6, 1.1, 2.1])
