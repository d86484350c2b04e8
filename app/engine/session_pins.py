"""Session pins: a conversation keeps the K/V of its last turn between turns.

A pin holds one reference on each block of the turn's prompt and reply, the partial last
block included, and the token ids those blocks hold. The next turn of the conversation
looks for the longest common token prefix with the pin; when its request is admitted the
pin is released (the request holds the blocks it shares; the rest fall into the LRU free
queue, full ones still findable through the prefix cache), and when the request ends its
blocks become the new pin.

Pins are a cache, not a promise: under memory pressure the least recently active idle
sessions lose theirs first, and a session idle longer than its TTL loses it too. A session
with a request in flight has no pin to lose (its request holds the blocks).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from app.engine.block_pool import Block, BlockPool


@dataclass
class Pin:
    blocks: list[Block]
    token_ids: list[int]
    last_active: float = field(default_factory=time.monotonic)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionPins:
    """Pinned blocks by session id, in least-recently-active order."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._pins: OrderedDict[str, Pin] = OrderedDict()  # oldest first
        self.unpins: Counter[str] = Counter()  # by reason: pressure, ttl, released

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._pins

    def pinned_tokens(self, session_id: str) -> list[int]:
        pin = self._pins.get(session_id)
        return list(pin.token_ids) if pin else []

    def lookup(self, session_id: str, token_ids: list[int], limit: int) -> tuple[list[Block], int]:
        """Blocks and token count of the longest common prefix of `token_ids` (at most
        `limit` tokens) with the session's pin."""
        pin = self._pins.get(session_id)
        if pin is None:
            return [], 0
        n = min(common_prefix(pin.token_ids, token_ids), limit)
        bs = self.block_size
        if n % bs and n // bs < len(pin.blocks):
            last = pin.blocks[n // bs]
            # The request will write its next tokens into this block. If the block is in
            # the prefix cache (it was full: an edit cut the prefix inside it) or someone
            # else holds it, writing would corrupt their copy: start at its boundary.
            if last.block_hash is not None or last.ref_count > 1:
                n -= n % bs
        return pin.blocks[: -(-n // bs)], n

    def pin(self, session_id: str, blocks: list[Block], token_ids: list[int]) -> None:
        """Take over `blocks` (the caller's references) as the session's pin."""
        self._release(session_id)
        self._pins[session_id] = Pin(blocks, token_ids)

    def release(self, session_id: str, reason: str = "released") -> bool:
        """Drop the session's pin (its blocks stay reusable until reallocated)."""
        if self._release(session_id):
            self.unpins[reason] += 1
            return True
        return False

    def _release(self, session_id: str) -> bool:
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return False
        self.pool.free(reversed(pin.blocks))
        return True

    def consume(self, session_id: str) -> None:
        """The session's next turn was admitted: it holds what it shares with the pin,
        and its end will pin anew. Not an unpin: nothing reusable was lost."""
        self._release(session_id)

    def evict_oldest(self, protected: set[str] | frozenset[str] = frozenset()) -> bool:
        """Unpin the least recently active session not in `protected` (sessions whose
        next turn is queued). False when there is none."""
        for session_id in self._pins:
            if session_id not in protected:
                return self.release(session_id, "pressure")
        return False

    def expire(self, ttl_s: float, now: float | None = None) -> int:
        """Unpin sessions idle for longer than `ttl_s`. Returns how many."""
        now = time.monotonic() if now is None else now
        stale = [sid for sid, pin in self._pins.items() if now - pin.last_active > ttl_s]
        for sid in stale:
            self.release(sid, "ttl")
        return len(stale)

    def holders(self) -> Counter[int]:
        return Counter(b.block_id for pin in self._pins.values() for b in pin.blocks)

    @property
    def num_blocks(self) -> int:
        return sum(len(p.blocks) for p in self._pins.values())
