"""The store worker: the engine hands blocks over and never waits, whatever the tier does."""

import threading
import time

import torch

from app.kvtier.entry import EntryLayout, decode_into
from app.kvtier.memory import MemoryTier
from app.kvtier.stats import TierCounters
from app.kvtier.store_worker import StoreWorker
from app.kvtier.tier import TierUnavailable

LAYOUT = EntryLayout(b"f" * 16, torch.float32, (2, 2, 4, 2, 8))  # 1 KiB blocks


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def blocks(n: int) -> torch.Tensor:
    return torch.randn(n, *LAYOUT.shape)


class StuckTier(MemoryTier):
    """A tier whose writes hang until released (a Redis that stopped answering)."""

    remote = True

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.release = threading.Event()

    def put_many(self, items):
        self.release.wait()
        super().put_many(items)


def test_blocks_are_written_in_the_background():
    tier, counters = MemoryTier(1 << 20), TierCounters()
    worker = StoreWorker(tier, LAYOUT, counters)
    data = blocks(3)
    assert worker.submit([key(i) for i in range(3)], data) == 3
    assert worker.flush(10)
    out = torch.empty(LAYOUT.shape)
    decode_into(LAYOUT, key(2), tier.get_many([key(2)])[0], out)
    assert torch.equal(out, data[2])
    assert counters.stores == 3 and sum(counters.store.counts) == 1  # one batch
    assert worker.wanted([key(2), key(5)]) == [False, True]  # a local tier is asked
    worker.close()


def test_a_full_queue_drops_and_counts_instead_of_blocking():
    tier, counters = StuckTier(), TierCounters()
    worker = StoreWorker(tier, LAYOUT, counters, max_pending_bytes=10 * LAYOUT.payload_bytes)
    t0 = time.monotonic()
    accepted = worker.submit([key(i) for i in range(25)], blocks(25))
    accepted += worker.submit([key(100 + i) for i in range(5)], blocks(5))
    assert time.monotonic() - t0 < 1.0  # the stuck tier never made the caller wait
    assert accepted == 10 and counters.stores_dropped == 20
    assert worker.wanted([key(0), key(99)]) == [False, True]  # queued: not copied again
    tier.release.set()
    assert worker.flush(10)
    assert counters.stores == 10
    assert worker.wanted([key(0)]) == [False]  # remote: remembered as written
    worker.close()


class DownTier(MemoryTier):
    remote = True

    def put_many(self, items):
        raise TierUnavailable("down")


def test_a_failed_write_is_counted_and_not_remembered():
    counters = TierCounters()
    worker = StoreWorker(DownTier(1 << 20), LAYOUT, counters)
    worker.submit([key(1)], blocks(1))
    assert worker.flush(10)
    assert counters.errors["unreachable"] == 1 and counters.stores_dropped == 1
    assert counters.stores == 0 and worker.wanted([key(1)]) == [True]
    worker.close()
