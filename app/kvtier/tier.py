"""The Tier protocol: a store of entries (app.kvtier.entry) by block key.

A key is a block's 16-byte chain hash; a backend keeps its entries under a namespace (the
model fingerprint's hex) so that models never see each other's. Every method is safe to
call from several threads at once (the store worker writes while the loader reads).
A backend that cannot be reached raises TierUnavailable, fast while it is known to be
down; `probe()` (the store worker calls it when idle) tries again and says whether it is
back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class TierUnavailable(RuntimeError):
    """The backend cannot be reached now (connection refused, timeout, known down)."""


@dataclass(frozen=True)
class TierUsage:
    bytes: int  # held by the backend (Redis: the server's used_memory, all keys)
    blocks: int | None  # entries held, when the backend knows cheaply


class Tier(Protocol):
    """Blocks' entries by key. Knows blocks and bytes, not requests."""

    name: str  # for logs and metrics: never a password
    remote: bool  # contains() costs a round trip: callers remember what they wrote
    # Changes whenever the backend may have lost what it held (a reconnect: the server
    # may have restarted empty), so that what callers remember as written is forgotten.
    generation: int

    @property
    def available(self) -> bool:
        """False while the backend is known to be unreachable."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store (key, entry) pairs. May drop some (a full budget). Raises TierUnavailable."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The entries of `keys`, None where missing. Raises TierUnavailable."""
        ...

    def contains(self, key: bytes) -> bool: ...

    def discard(self, key: bytes) -> None:
        """Forget one entry (a bad one, found by a reader)."""
        ...

    def usage(self) -> TierUsage:
        """What it holds, without a round trip (a remote backend answers from its last
        probe)."""
        ...

    def probe(self) -> bool:
        """Check the backend (reconnect if it was down, refresh usage); True if up."""
        ...

    def close(self) -> None: ...
