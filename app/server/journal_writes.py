"""The journal's frame writes (app.server.journal): group commit of fenced appends.

Every turn's writes go through one queue: whatever queued while the last Redis round trip
was out goes in the next one, one pipeline of WRITE scripts (app.server.journal_scripts),
so the cost is a round trip of latency per frame, not one per turn. Each WRITE appends
only while the turn's entry is still this process's and its record as long as this process
left it; what comes back says which: written (now, or by an earlier try whose answer was
lost), `lost` (another process took the turn over), the record damaged, or Redis failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from app.server.journal_records import JournalEntry

log = logging.getLogger("app.server.journal")


@dataclass
class _Write:
    entry: JournalEntry
    items: list[str]
    ttl: int  # > 0: the turn ends (acknowledged, record expires)
    frames: int  # token frames it records
    done: asyncio.Future[bool] = field(repr=False)


@dataclass
class WriteCounts:
    writes: int = 0  # frames recorded
    errors: int = 0  # round trips that failed
    flushes: int = 0  # round trips that recorded frames
    seconds: float = 0.0  # their total time


class FrameWriter:
    """Queues writes of turns' records and commits them in groups."""

    def __init__(
        self,
        redis: Any,
        script: Any,  # the registered WRITE script
        stream: str,
        group: str,
        consumer: str,
        on_lost: Callable[[JournalEntry], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._redis, self._script = redis, script
        self._stream, self._group, self._consumer = stream, group, consumer
        self._on_lost, self._on_error = on_lost, on_error
        self._queue: list[_Write] = []
        self._flusher: asyncio.Task[None] | None = None
        self.counts = WriteCounts()

    async def write(
        self, entry: JournalEntry, items: list[str], ttl: int, frames: int
    ) -> int | None:
        """Append `items` to the entry's record (with ttl > 0: and end the turn). Returns
        WRITE's answer (1 or 2: written; 0: lost to another process; -1: the record is not
        as we left it), or None when Redis failed."""
        done = asyncio.get_running_loop().create_future()
        self._queue.append(_Write(entry, items, ttl, frames, done))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        return await done

    async def close(self) -> None:
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                began = time.perf_counter()
                results: list[Any] = [None] * len(batch)
                try:
                    results = await self._commit(batch)
                except RedisError as exc:
                    self.counts.errors += 1
                    self._on_error(exc)
                self.counts.seconds += time.perf_counter() - began
                self.counts.flushes += 1
                for write, result in zip(batch, results, strict=True):
                    write.done.set_result(self._settle(write, result))
        finally:
            self._flusher = None

    async def _commit(self, batch: list[_Write]) -> list[Any]:
        length: dict[str, int] = {}  # a turn may have several writes in one batch
        async with self._redis.pipeline(transaction=False) as pipe:
            for w in batch:
                e = w.entry
                at = length.get(e.entry_id, e.items)
                length[e.entry_id] = at + len(w.items)
                args = [self._group, self._consumer, e.entry_id, at, w.ttl, *w.items]
                await self._script([self._stream, e.record_key], args, client=pipe)
            return await pipe.execute()

    def _settle(self, write: _Write, result: Any) -> int | None:
        entry = write.entry
        if result in (1, 2):
            entry.items += len(write.items)
            self.counts.writes += write.frames
        elif result == 0:
            self._on_lost(entry)
        elif result == -1:
            log.warning("journal: record %s is not as this process left it (Redis lost "
                        "writes?)", entry.record_key)  # fmt: skip
        return result
