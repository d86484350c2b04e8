"""A folder as the tier: one file per entry, under a byte budget, least recently used
out first. Entries survive a restart (and an upgrade that keeps the model fingerprint).

Files are written whole to a temporary name and renamed, so a reader never sees half an
entry (a crash mid-write leaves a stray temporary file, removed at the next start). The
folder is created private (0700): it holds conversations' K/V.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from app.kvtier.tier import TierUnavailable, TierUsage

SUFFIX = ".kvb"


class DiskTier:
    """Entries as files in `folder/<namespace>/`, at most `capacity_bytes` of them."""

    remote = False
    generation = 0  # never loses entries behind our back

    def __init__(self, folder: str | Path, namespace: str, capacity_bytes: int) -> None:
        self.root = Path(folder) / namespace
        self.name = f"disk:{folder}"
        self.capacity_bytes = capacity_bytes
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> size, oldest first
        self._bytes = 0
        self._scan()

    def _scan(self) -> None:
        """Rebuild the index from the folder, oldest modification first."""
        files = []
        for path in self.root.glob("*/*"):
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                try:
                    st = path.stat()
                    files.append((st.st_mtime, bytes.fromhex(path.stem), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, key, size in sorted(files):
            self._index[key] = size
            self._bytes += size
        self._evict()

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + SUFFIX)

    @property
    def available(self) -> bool:
        return True

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for key, entry in items:
            if len(entry) > self.capacity_bytes:
                continue
            path = self._path(key)
            tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
            try:
                path.parent.mkdir(exist_ok=True, mode=0o700)
                tmp.write_bytes(entry)
                os.replace(tmp, path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
                raise TierUnavailable(f"{self.name}: {exc.strerror}") from None
            with self._lock:
                self._bytes += len(entry) - self._index.pop(key, 0)
                self._index[key] = len(entry)
                self._evict()

    def _evict(self) -> None:
        while self._bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self._path(key).unlink(missing_ok=True)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self._path(key).read_bytes())
            except FileNotFoundError:
                out.append(None)
                self.discard(key)
                continue
            except OSError as exc:
                raise TierUnavailable(f"{self.name}: {exc.strerror}") from None
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
        return out

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._bytes -= self._index.pop(key, 0)
        self._path(key).unlink(missing_ok=True)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._bytes, len(self._index))

    def probe(self) -> bool:
        return True

    def close(self) -> None:
        pass
