"""/metrics: Prometheus metrics with vLLM's names and meanings where they exist (prefix
`parley:` instead of `vllm:`), plus Parley's own for session pins and the KV tier.

Request-level figures are recorded on the engine's thread as tokens and requests finish
(an EngineListener); gauges and the scheduler's counters are read at scrape time from the
engine's last stats snapshot. Each app has its own registry: two apps in one process (as
in tests) do not share numbers.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from app.engine.outputs import ITL_OVER, FinishedRequestStats
from app.engine.protocol import EngineClient
from app.kvtier.stats import HistogramSnapshot, TierStats
from app.server.journal import Journal
from app.server.streams import Streams

P = "parley:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets in seconds: a CPU box spans milliseconds (a cached turn) to minutes.
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_ITL = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)


class Metrics:
    """The app's metrics. Attach with `engine.listeners.append(metrics)`. With `key`
    (--metrics-key), a scrape must bring it as `Authorization: Bearer <key>`: the figures
    are every tenant's together, so no tenant's key opens them."""

    def __init__(self, engine: EngineClient, key: str | None = None) -> None:
        self.engine = engine  # its stats() snapshot is read at scrape time
        self._key = hashlib.sha256(key.encode()).digest() if key else None
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds", "Time between tokens.", buckets=_ITL, registry=r
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Arrival to finish of a request.",
            buckets=_LATENCY,
            registry=r,
        )
        self.queue = Histogram(
            P + "request_queue_time_seconds",
            "Arrival to first scheduling of a request.",
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            P + "generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.success = Counter(
            P + "request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        r.register(_EngineCollector(engine))
        ProcessCollector(registry=r)  # process_resident_memory_bytes etc. (soak tests)

    # -- EngineListener (called on the engine's thread) -----------------------------------

    def on_tokens(self, request_id: str, num_tokens: int, gap_s: float | None) -> None:
        if gap_s is not None:
            self.itl.observe(gap_s)

    def on_finished(self, stats: FinishedRequestStats) -> None:
        t = stats.timings
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
        if t.first_scheduled is not None:
            self.queue.observe(t.first_scheduled - t.arrival)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_output_tokens)
        self.success.labels(str(stats.finish_reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def allows(self, authorization: str) -> bool:
        """Whether a scrape with this Authorization header may read the metrics."""
        if self._key is None:
            return True
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = hashlib.sha256(token.strip().encode()).digest()
        return hmac.compare_digest(given, self._key)


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's stats snapshot at scrape time."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        yield GaugeMetricFamily(P + "num_requests_running", "Requests in the batch.", s.num_running)
        yield GaugeMetricFamily(
            P + "num_requests_waiting", "Requests waiting for the batch.", s.num_waiting
        )
        yield GaugeMetricFamily(
            P + "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", s.kv_usage
        )
        yield GaugeMetricFamily(
            P + "kv_cache_resident_bytes",
            "Bytes of the KV pool written so far (its memory becomes resident on first use), "
            "less what local attention layers gave back.",
            s.kv_resident_bytes,
        )
        yield GaugeMetricFamily(
            P + "sessions_pinned", "Conversations holding pinned K/V.", s.sessions_pinned
        )
        yield CounterMetricFamily(
            P + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_queries,
        )
        yield CounterMetricFamily(
            P + "prefix_cache_hits",
            "Prompt tokens found in the prefix cache or a session pin.",
            s.prefix_hits + s.pin_hits,
        )
        yield CounterMetricFamily(
            P + "num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions
        )
        unpins = CounterMetricFamily(
            P + "session_unpins",
            "Sessions that lost their pinned K/V, by reason (pressure, ttl, released).",
            labels=["reason"],
        )
        for reason in ("pressure", "ttl", "released"):
            unpins.add_metric([reason], s.session_unpins.get(reason, 0))
        yield unpins
        if s.step is not None:  # the batching policy's last step (app.engine.policy)
            yield GaugeMetricFamily(
                P + "step_prefill_tokens",
                "Prefill tokens the batching policy granted the last step (its budget).",
                s.step.prefill_tokens,
            )
            times = GaugeMetricFamily(
                P + "step_time_seconds",
                "The last step's time: predicted by the cost model, and measured.",
                labels=["kind"],
            )
            times.add_metric(["predicted"], s.step.predicted_s)
            times.add_metric(["measured"], s.step.measured_s)
            yield times
            yield GaugeMetricFamily(
                P + "step_cost_model_error",
                "Mean relative error of the step-cost model over recent steps.",
                s.step.model_error,
            )
            if s.step.itl_target_s is not None:
                yield GaugeMetricFamily(
                    P + "itl_target_seconds",
                    "The inter-token target that sizes prefill chunks beside decodes.",
                    s.step.itl_target_s,
                )
                yield GaugeMetricFamily(
                    P + "itl_plan_margin",
                    "Chunks beside decodes are planned to the target divided by this: the "
                    "cost model's recent overrun on such steps (its 90th percentile).",
                    s.step.itl_margin,
                )
        if s.itl_gaps:  # the engine's own inter-token gaps against the target
            yield CounterMetricFamily(
                P + "itl_gaps",
                "Inter-token gaps measured by the engine against the inter-token target.",
                s.itl_gaps,
            )
            over = CounterMetricFamily(
                P + "itl_gaps_over_target",
                "Of those, the gaps longer than `times` x the target (before delivery).",
                labels=["times"],
            )
            for times, count in zip(ITL_OVER, s.itl_gaps_over):
                over.add_metric([f"{times:g}"], count)
            yield over
        if s.cpu_threads:  # one engine on the CPU; replicas report theirs below
            yield GaugeMetricFamily(
                P + "cpu_threads", "CPU threads the engine computes with now.", s.cpu_threads
            )
        yield CounterMetricFamily(
            P + "cpu_thread_changes",
            "Times the thread count followed the machine (a CPU contended or freed).",
            s.thread_changes,
        )
        if s.replicas:  # engine replicas (app.cluster): load each, and routing decisions
            live = GaugeMetricFamily(P + "replica_up", "Replica answering (1) or not (0).",
                                     labels=["replica"])  # fmt: skip
            load = GaugeMetricFamily(
                P + "replica_requests_in_flight",
                "Requests routed to a replica and not yet finished.",
                labels=["replica"],
            )
            running = GaugeMetricFamily(
                P + "replica_num_requests_running", "Requests in a replica's batch.",
                labels=["replica"],
            )  # fmt: skip
            threads = GaugeMetricFamily(
                P + "cpu_threads", "CPU threads a replica computes with now.",
                labels=["replica"],
            )  # fmt: skip
            for r in s.replicas:
                live.add_metric([r.name], float(r.live))
                load.add_metric([r.name], r.in_flight)
                running.add_metric([r.name], r.num_running)
                if r.cpu_threads:
                    threads.add_metric([r.name], r.cpu_threads)
            yield live
            yield load
            yield running
            yield threads
            routing = CounterMetricFamily(
                P + "routing_decisions",
                "Requests routed, by decision: affine (a key's request to its K/V's "
                "replica), rebalanced (its replica was too busy or gone), prefix (no key: to "
                "the replica holding the longest cached prefix), balanced (no key and no "
                "useful cached prefix: least loaded).",
                labels=["decision"],
            )
            for decision in ("affine", "rebalanced", "prefix", "balanced"):
                routing.add_metric([decision], s.routing.get(decision, 0))
            yield routing
        if s.tier is not None:
            yield CounterMetricFamily(
                P + "external_prefix_cache_hits",
                "Prompt tokens loaded from the KV tier (not in prefix_cache_hits).",
                s.tier_hits,
            )
            yield from _tier_metrics(s.tier)


class ResumeCollector(Collector):
    """Turns that outlive their socket and the turn journal, read at scrape time
    (app.server.streams, app.server.journal)."""

    def __init__(self, streams: Streams, journal: Journal | None) -> None:
        self.streams = streams
        self.journal = journal

    def collect(self) -> Iterator[Metric]:
        s = self.streams.stats()
        yield GaugeMetricFamily(
            P + "turns_detached", "Running turns whose socket dropped.", s.detached
        )
        yield CounterMetricFamily(P + "turn_resumes", "Turns resumed on a new socket.", s.resumes)
        yield CounterMetricFamily(
            P + "turns_expired", "Turns cancelled because nobody resumed them in time.", s.expired
        )
        if self.journal is None:
            return
        j = self.journal.stats()
        yield GaugeMetricFamily(P + "journal_up", "1 while the turn journal is reachable.", j.up)
        yield CounterMetricFamily(P + "journal_turns", "Turns appended to the journal.", j.turns)
        yield CounterMetricFamily(
            P + "journal_unjournaled_turns",
            "Turns served without durability (the journal was unreachable).",
            j.unjournaled,
        )
        yield CounterMetricFamily(
            P + "journal_frames", "Token frames recorded before they were sent.", j.writes
        )
        yield CounterMetricFamily(
            P + "journal_write_errors", "Journal round trips that failed.", j.write_errors
        )
        yield CounterMetricFamily(
            P + "journal_flushes", "Journal round trips that recorded frames.", j.flushes
        )
        yield CounterMetricFamily(
            P + "journal_flush_seconds", "Time spent in those round trips.", j.flush_seconds
        )
        yield CounterMetricFamily(
            P + "journal_recovered_turns",
            "Turns taken over from the journal (a restart, or a silent process).",
            j.recovered,
        )
        for name, text, value in (
            ("skipped_entries", "Stream entries not ours, skipped on the way to our own.",
             j.skipped),
            ("dropped_entries", "Journal entries dropped: no record, or one not ours or not "
             "whole.", j.dropped),
            ("taken_over_turns", "Turns another server took over while this one stalled.",
             j.taken_over),
            ("settled_accepts", "Accepts that timed out yet had happened, cleared up.",
             j.settled),
        ):  # fmt: skip
            yield CounterMetricFamily(P + "journal_" + name, text, value)


TIER_ERRORS = ("unreachable", "checksum", "truncated", "foreign", "format", "load", "store")


def _tier_metrics(t: TierStats) -> Iterator[Metric]:
    """The KV tier's figures (app.kvtier.stats); its blocks are whole KV blocks."""
    info = GaugeMetricFamily(
        P + "kv_tier_info", "The KV tier in use (password redacted).", labels=["backend"]
    )
    info.add_metric([t.backend], 1)
    yield info
    yield GaugeMetricFamily(
        P + "kv_tier_up", "1 while the KV tier is reachable, 0 while serving without it.",
        int(t.available),
    )  # fmt: skip
    yield GaugeMetricFamily(P + "kv_tier_bytes", "Bytes the KV tier holds.", t.bytes_held)
    for name, doc, value in (
        ("hits", "KV blocks loaded from the tier into the cache.", t.hits),
        ("misses", "KV blocks looked up in the tier and not found there (or unusable).",
         t.misses),
        ("stores", "KV blocks written to the tier.", t.stores),
        ("stores_dropped", "KV blocks not written: the store queue was full or the tier down.",
         t.stores_dropped),
        ("loads_skipped", "Tier lookups not made: recomputing was estimated cheaper.",
         t.loads_skipped),
    ):  # fmt: skip
        yield CounterMetricFamily(P + "kv_tier_" + name, doc, value)
    errors = CounterMetricFamily(
        P + "kv_tier_errors",
        "KV tier errors by reason (each one a recompute or a lost store).",
        labels=["reason"],
    )
    for reason in sorted(set(TIER_ERRORS) | set(t.errors)):
        errors.add_metric([reason], t.errors.get(reason, 0))
    yield errors
    for name, doc, h in (
        ("load_seconds", "One tier lookup: fetch, check and unpack (loader thread).",
         t.load_seconds),
        ("store_seconds", "One batch of stores: encode, checksum, write (store worker).",
         t.store_seconds),
        ("copy_seconds", "Engine-thread time copying blocks out of or into the KV cache.",
         t.copy_seconds),
    ):  # fmt: skip
        yield _histogram(P + "kv_tier_" + name, doc, h)


def _histogram(name: str, doc: str, h: HistogramSnapshot) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for le, count in zip((*map(str, h.buckets), "+Inf"), h.counts):
        cumulative += count
        buckets.append((le, cumulative))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h.total)
