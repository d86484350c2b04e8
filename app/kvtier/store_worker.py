"""Writes blocks to the tier on a background thread, so that an engine step pays only for
copying a block's K/V out of the cache (~0.1 ms per 720 KB block), never for the checksum,
the encoding or the network.

The queue is bounded in bytes: when the tier falls behind, new blocks are dropped and
counted (the engine never waits for it). It remembers what it wrote to a remote tier, so
a block freed again and again is sent once (for a while: Redis may expire or evict it).
When idle it probes the tier, which is how an unreachable Redis comes back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

from app.kvtier.entry import EntryLayout, encode
from app.kvtier.stats import TierCounters
from app.kvtier.tier import Tier, TierUnavailable

log = logging.getLogger("parley.kvtier")

MAX_PENDING_BYTES = 256 << 20  # ~350 fp32 blocks of SmolLM2-135M: a burst of long turns
BATCH_BYTES = 16 << 20  # one Redis pipeline: ~22 blocks
KNOWN_KEYS = 1 << 16  # keys remembered as written (~10 MB of bookkeeping)


class StoreWorker:
    """A thread that encodes and writes (key, block) pairs to `tier`."""

    def __init__(
        self,
        tier: Tier,
        layout: EntryLayout,
        counters: TierCounters,
        known_ttl_s: float = 3600.0,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        idle_s: float = 1.0,
    ) -> None:
        self.tier = tier
        self.layout = layout
        self.counters = counters
        self.known_ttl_s = known_ttl_s
        self.max_pending_bytes = max_pending_bytes
        self.idle_s = idle_s
        self._queue: deque[tuple[bytes, torch.Tensor, bool]] = deque()
        self._queued: set[bytes] = set()
        self._pending_bytes = 0
        self._busy = False
        self._known: OrderedDict[bytes, float] = OrderedDict()  # key -> when written
        self._known_generation = tier.generation
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="parley-kv-store", daemon=True)
        self._thread.start()

    def wanted(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of `keys` are worth copying out: neither queued nor (as far as we know)
        in the tier already."""
        now = time.monotonic()
        with self._cv:
            if self._known_generation != self.tier.generation:
                self._known.clear()  # the tier may have come back empty
                self._known_generation = self.tier.generation
            out = []
            for key in keys:
                if key in self._queued:
                    out.append(False)
                elif self.tier.remote:
                    written = self._known.get(key)
                    out.append(written is None or now - written > self.known_ttl_s)
                else:
                    out.append(not self.tier.contains(key))
            return out

    def submit(
        self, keys: Sequence[bytes], blocks: torch.Tensor, windowed: Sequence[bool] = ()
    ) -> int:
        """Queue blocks[i] under keys[i] (a CPU tensor the caller gives up), windowed[i]
        (default: none is) its entry's WINDOWED flag. Returns how many were accepted; the
        rest are dropped and counted."""
        size = self.layout.payload_bytes
        with self._cv:
            room = max(0, (self.max_pending_bytes - self._pending_bytes) // size)
            accepted = min(room, len(keys))
            for i in range(accepted):
                self._queue.append((keys[i], blocks[i], bool(windowed) and windowed[i]))
                self._queued.add(keys[i])
            self._pending_bytes += accepted * size
            if accepted:
                self._cv.notify_all()
        if accepted < len(keys):
            self.counters.add(stores_dropped=len(keys) - accepted)
        return accepted

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued is written (or failed). For tests and shutdown."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._queue and not self._stopping:
                    self._cv.wait(self.idle_s)
                if self._stopping:
                    return
                batch: list[tuple[bytes, torch.Tensor, bool]] = []
                while self._queue and len(batch) * self.layout.payload_bytes < BATCH_BYTES:
                    batch.append(self._queue.popleft())
                self._busy = bool(batch)
            try:
                if batch:
                    self._write(batch)
                self.tier.probe()  # reconnects a Redis that was down; refreshes usage
            except Exception:  # a bug here must not end the thread (and every later store)
                log.exception("KV tier store worker")
            finally:
                with self._cv:
                    for key, _, _ in batch:
                        self._queued.discard(key)
                    self._pending_bytes -= len(batch) * self.layout.payload_bytes
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, batch: list[tuple[bytes, torch.Tensor, bool]]) -> None:
        t0 = time.perf_counter()
        try:
            entries = [(key, encode(self.layout, key, block, w)) for key, block, w in batch]
            self.tier.put_many(entries)
        except TierUnavailable:
            self.counters.add(stores_dropped=len(batch))
            self.counters.error("unreachable", None)  # the backend logged it
            return
        except Exception as exc:
            self.counters.add(stores_dropped=len(batch))
            self.counters.error("store", f"storing {len(batch)} blocks failed: {exc!r}")
            return
        self.counters.observe("store", time.perf_counter() - t0)
        self.counters.add(stores=len(batch))
        if self.tier.remote:
            now = time.monotonic()
            with self._cv:
                if self._known_generation != self.tier.generation:
                    return  # written before an outage: maybe lost, remember nothing
                for key, _, _ in batch:
                    self._known[key] = now
                    self._known.move_to_end(key)
                while len(self._known) > KNOWN_KEYS:
                    self._known.popitem(last=False)
