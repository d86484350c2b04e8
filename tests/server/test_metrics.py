"""/metrics from a stats snapshot: the KV tier's counters, gauges and histograms, and the
batching policy's last step."""

from prometheus_client.parser import text_string_to_metric_families

from app.engine.outputs import EngineStats, StepReport
from app.kvtier.stats import HistogramSnapshot, TierStats
from app.server.metrics import Metrics

BUCKETS = (0.001, 0.01, 0.1)


class StatsOnly:
    def __init__(
        self, tier: TierStats | None, step: StepReport | None = None, gaps=(0, ())
    ) -> None:
        self.tier = tier
        self.step = step
        self.gaps = gaps

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=0,
            num_waiting=3,
            kv_usage=0.0,
            num_free_blocks=10,
            num_blocks=10,
            num_preemptions=0,
            prefix_queries=100,
            prefix_hits=20,
            pin_hits=30,
            sessions_pinned=0,
            pinned_blocks=0,
            session_unpins={},
            steps=5,
            tier_hits=48,
            tier=self.tier,
            step=self.step,
            itl_gaps=self.gaps[0],
            itl_gaps_over=self.gaps[1],
        )


def tier_stats() -> TierStats:
    return TierStats(
        backend="redis://:***@127.0.0.1:6379/0",
        available=False,
        hits=3,
        misses=7,
        stores=11,
        stores_dropped=2,
        loads_skipped=1,
        errors={"unreachable": 4, "checksum": 1},
        bytes_held=12345,
        blocks_held=None,
        load_seconds=HistogramSnapshot(BUCKETS, (1, 2, 0, 1), 0.5),
        store_seconds=HistogramSnapshot(BUCKETS, (0, 0, 0, 0), 0.0),
        copy_seconds=HistogramSnapshot(BUCKETS, (5, 0, 0, 0), 0.002),
    )


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_tier_metrics_are_exported():
    got = samples(Metrics(StatsOnly(tier_stats())))
    assert got[("parley:kv_tier_hits_total", ())] == 3
    assert got[("parley:kv_tier_misses_total", ())] == 7
    assert got[("parley:kv_tier_stores_total", ())] == 11
    assert got[("parley:kv_tier_stores_dropped_total", ())] == 2
    assert got[("parley:kv_tier_errors_total", (("reason", "unreachable"),))] == 4
    assert got[("parley:kv_tier_errors_total", (("reason", "foreign"),))] == 0
    assert got[("parley:kv_tier_bytes", ())] == 12345
    assert got[("parley:kv_tier_up", ())] == 0
    assert got[("parley:external_prefix_cache_hits_total", ())] == 48
    assert got[("parley:prefix_cache_hits_total", ())] == 50  # pool and pins, not the tier
    assert got[("parley:kv_tier_load_seconds_count", ())] == 4
    assert got[("parley:kv_tier_load_seconds_bucket", (("le", "0.01"),))] == 3
    assert got[("parley:kv_tier_load_seconds_bucket", (("le", "+Inf"),))] == 4
    assert got[("parley:kv_tier_load_seconds_sum", ())] == 0.5
    assert ("parley:kv_tier_store_seconds_count", ()) in got
    info = [k for k in got if k[0] == "parley:kv_tier_info"]
    assert info == [("parley:kv_tier_info", (("backend", "redis://:***@127.0.0.1:6379/0"),))]


def test_no_tier_no_tier_metrics():
    got = samples(Metrics(StatsOnly(None)))
    assert not [k for k in got if "kv_tier" in k[0]]


def test_the_batching_policys_last_step_is_exported():
    step = StepReport(
        prefill_tokens=96,
        decodes=5,
        predicted_s=0.041,
        measured_s=0.046,
        itl_target_s=0.05,
        model_error=0.07,
        itl_margin=1.13,
    )
    got = samples(Metrics(StatsOnly(None, step, gaps=(1000, (40, 9, 2, 0)))))
    assert got[("parley:step_prefill_tokens", ())] == 96
    assert got[("parley:step_time_seconds", (("kind", "predicted"),))] == 0.041
    assert got[("parley:step_time_seconds", (("kind", "measured"),))] == 0.046
    assert got[("parley:step_cost_model_error", ())] == 0.07
    assert got[("parley:itl_target_seconds", ())] == 0.05
    assert got[("parley:itl_plan_margin", ())] == 1.13
    assert got[("parley:num_requests_waiting", ())] == 3  # the queue's depth
    # The engine's own gaps against the target: all, and those over 1, 1.2, 1.5, 2x it.
    assert got[("parley:itl_gaps_total", ())] == 1000
    over = {
        dict(k[1])["times"]: v
        for k, v in got.items()
        if k[0] == "parley:itl_gaps_over_target_total"
    }
    assert over == {"1": 40, "1.2": 9, "1.5": 2, "2": 0}
    # The static policy has no target, and so no margin either.
    static = samples(Metrics(StatsOnly(None, StepReport(prefill_tokens=48, decodes=2))))
    assert static[("parley:step_prefill_tokens", ())] == 48
    assert not [
        k
        for k in static
        if k[0] in ("parley:itl_target_seconds", "parley:itl_plan_margin", "parley:itl_gaps_total")
    ]
