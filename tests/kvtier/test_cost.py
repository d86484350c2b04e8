"""Load or recompute: the cost model's choice from what it measured."""

from app.kvtier.cost import LoadCostModel

BLOCK = 737_280  # bytes of one fp32 block of SmolLM2-135M
TOKENS = 16


def model(kind: str, min_speedup: float = 1.0) -> LoadCostModel:
    return LoadCostModel.for_backend(kind, BLOCK, TOKENS, min_speedup)


def test_a_cpu_prefill_is_always_worth_loading_from_memory_or_redis():
    for kind in ("memory", "redis", "disk"):
        m = model(kind)
        assert m.worth_loading(1) and m.worth_loading(125)
        assert not m.worth_loading(0)


def test_a_fast_compute_and_a_slow_tier_recompute():
    m = model("redis")
    for _ in range(50):
        m.observe_compute(2048, 0.02)  # 10 us a token: a GPU
        m.observe_load(100 * BLOCK, 2.0)  # ~37 MB/s: a distant, busy Redis
    assert m.compute_s_per_token < 2e-5 and m.bandwidth < 1e8
    assert not m.worth_loading(125)


def test_the_latency_of_one_lookup_decides_for_short_runs():
    m = model("redis")
    m.compute_s_per_token = 2e-6
    assert not m.worth_loading(1)  # 32 us of compute against a 1 ms round trip
    assert m.load_s(100) > m.load_s(1)


def test_min_speedup_zero_always_loads_and_a_huge_one_never():
    fast_compute = model("redis", 0.0)
    fast_compute.compute_s_per_token = 1e-9
    assert fast_compute.worth_loading(1)
    assert not model("memory", 1e9).worth_loading(125)


def test_small_observations_do_not_move_the_estimates():
    m = model("redis")
    before = (m.bandwidth, m.compute_s_per_token)
    m.observe_load(1000, 1.0)  # one tiny block: latency, not bandwidth
    m.observe_compute(1, 1.0)  # a lone decode
    assert (m.bandwidth, m.compute_s_per_token) == before
