"""Counters and latency histograms of a tier, updated from the engine's thread, the store
worker and the loader; read as frozen snapshots (TierStats) for metrics and benchmarks."""

from __future__ import annotations

import bisect
import logging
import threading
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger("parley.kvtier")

# Seconds: a memory copy of one block is ~0.1 ms, a 2,000-token history from Redis ~0.1 s.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Counts per bucket (not cumulative; the last is +Inf) and the sum of observations."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        return sum(self.counts)


class Histogram:
    """Not thread-safe by itself: TierCounters holds the lock."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self.counts), self.total)


@dataclass(frozen=True)
class TierStats:
    """A tier's figures since start. Hits, misses and stores count blocks."""

    backend: str  # the tier as logs name it (no password)
    available: bool
    hits: int  # blocks loaded into the cache
    misses: int  # blocks looked up after the pool's prefix and not found (or not usable)
    stores: int  # blocks written
    stores_dropped: int  # blocks not written: the store queue was full or the tier down
    loads_skipped: int  # lookups not made: recomputing was estimated cheaper
    errors: dict[str, int]  # by reason: unreachable, checksum, truncated, foreign, ...
    bytes_held: int
    blocks_held: int | None
    load_seconds: HistogramSnapshot  # one lookup: fetch, check, unpack (loader thread)
    store_seconds: HistogramSnapshot  # one batch: encode, checksum, write (store worker)
    copy_seconds: HistogramSnapshot  # engine thread: blocks copied out of or into the cache


class TierCounters:
    """The mutable side of TierStats. The first error of each reason is logged (with
    what happened); later ones are only counted, so a bad tier cannot flood the log."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.stores = 0
        self.stores_dropped = 0
        self.loads_skipped = 0
        self.errors: Counter[str] = Counter()
        self.load = Histogram()
        self.store = Histogram()
        self.copy = Histogram()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def observe(self, histogram: str, seconds: float) -> None:
        with self._lock:
            getattr(self, histogram).observe(seconds)

    def error(self, reason: str, detail: str | None) -> None:
        """Count an error; log the first of its reason unless `detail` is None (the
        backend has said it already: an unreachable Redis logs once per outage)."""
        with self._lock:
            self.errors[reason] += 1
            first = self.errors[reason] == 1
        if first and detail is not None:
            log.warning(
                "KV tier: %s (%s); recomputing instead. Later ones are counted in "
                "parley:kv_tier_errors_total{reason=%r}, not logged",
                detail,
                reason,
                reason,
            )

    def snapshot(
        self, backend: str, available: bool, bytes_held: int, blocks_held: int | None
    ) -> TierStats:
        with self._lock:
            return TierStats(
                backend=backend,
                available=available,
                hits=self.hits,
                misses=self.misses,
                stores=self.stores,
                stores_dropped=self.stores_dropped,
                loads_skipped=self.loads_skipped,
                errors=dict(self.errors),
                bytes_held=bytes_held,
                blocks_held=blocks_held,
                load_seconds=self.load.snapshot(),
                store_seconds=self.store.snapshot(),
                copy_seconds=self.copy.snapshot(),
            )
