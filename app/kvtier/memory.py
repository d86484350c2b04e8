"""Host memory: entries in a dict under a byte budget, least recently used out first.

The embedded default: no server to run, and restoring a 2,000-token history from it takes
a memory copy and a checksum (tens of milliseconds) against seconds of prefill.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from app.kvtier.tier import TierUsage


class MemoryTier:
    """Entries in this process's memory, at most `capacity_bytes` of them."""

    remote = False
    generation = 0  # never loses entries behind our back

    def __init__(self, capacity_bytes: int, name: str = "memory") -> None:
        self.capacity_bytes = capacity_bytes
        self.name = name
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()  # oldest use first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return True

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        with self._lock:
            for key, entry in items:
                if len(entry) > self.capacity_bytes:
                    continue
                old = self._entries.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                self._entries[key] = entry
                self._bytes += len(entry)
            while self._bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= len(evicted)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                out.append(entry)
        return out

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def discard(self, key: bytes) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._bytes -= len(entry)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._bytes, len(self._entries))

    def probe(self) -> bool:
        return True

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
