"""Which replica serves a request: conversation affinity or the longest cached prefix,
bounded by load.

A request with a routing key (a conversation, an API `user` or `prompt_cache_key`) goes
to the key's home replica, the one that served it last and so holds its K/V, unless the
home is loaded past the least-loaded replica by more than `threshold` requests: then it
goes to the least-loaded one, which becomes its new home. A key seen for the first time
gets a home by rendezvous hashing, so keys spread evenly and the same key finds the same
replica from any front.

A request without a key is routed by what the replicas hold: each replica publishes the
hashes of its cached KV blocks (a bounded set, with its heartbeat), the request's prompt
is hashed block by block the way the engine hashes it, and the replica holding the
longest run of its leading blocks serves it, unless that run is shorter than
`min_prefix_blocks` (a shared chat template's first block says little) or that replica
is too loaded: then the least-loaded one does. A routed request's blocks count as that
replica's at once, before its next heartbeat, so a burst of requests that share a
system prompt follows the first. (SGLang's cache-aware router and Ray Serve's
prefix-aware one work this way: cache affinity first, a load bound second.)
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from app.engine.kv_manager import hash_block, salt_root

AFFINE = "affine"  # to the replica that holds the key's K/V
REBALANCED = "rebalanced"  # its home was too busy (or gone): to the least loaded
PREFIX = "prefix"  # no key: to the replica holding the longest cached prefix
BALANCED = "balanced"  # no key and no useful cached prefix (or it was too busy): least loaded
DECISIONS = (AFFINE, REBALANCED, PREFIX, BALANCED)
MAX_HOMES = 100_000
ROUTING_BLOCKS = 256  # a prompt's leading blocks hashed for prefix-aware routing


def prompt_block_hashes(
    ids: Sequence[int], salt: str | None, block_size: int, max_blocks: int = ROUTING_BLOCKS
) -> list[bytes]:
    """A prompt's leading full blocks, named as the engine names them (kv_manager): the
    same chain of hashes, from the same salt."""
    hashes: list[bytes] = []
    parent = salt_root(salt)
    for start in range(0, min(len(ids) // block_size, max_blocks) * block_size, block_size):
        parent = hash_block(parent, list(ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


def rendezvous(key: str, candidates: Sequence[int]) -> int:
    """The candidate with the highest hash of (key, candidate): stable as replicas come
    and go (only the keys of a lost replica move)."""
    return max(
        candidates, key=lambda c: hashlib.blake2b(f"{c}:{key}".encode(), digest_size=8).digest()
    )


class Router:
    """Picks replicas; remembers each key's home (bounded, least recently used out) and
    each replica's published block hashes."""

    def __init__(self, threshold: int = 4, min_prefix_blocks: int = 2) -> None:
        self.threshold = threshold
        self.min_prefix_blocks = min_prefix_blocks
        self._homes: OrderedDict[str, int] = OrderedDict()
        self._held: dict[int, set[bytes]] = {}  # replica -> hashes of blocks it holds
        self._routed: dict[int, set[bytes]] = {}  # replica -> hashes routed since its beat
        self.decisions: Counter[str] = Counter()

    def pick(self, key: str | None, loads: dict[int, int]) -> tuple[int, str]:
        """The replica for a request with a routing key and why, among the live ones
        (`loads`: replica -> requests in flight). Raises ValueError when none is live."""
        least = _least(loads)
        if key is None:
            return self._decided(least, BALANCED)
        home = self._homes.get(key)
        if home is None or home not in loads:
            home = rendezvous(key, sorted(loads)) if home is None else home
        if home in loads and loads[home] <= loads[least] + self.threshold:
            decision, replica = AFFINE, home
        else:
            decision, replica = REBALANCED, least
        self._homes[key] = replica
        self._homes.move_to_end(key)
        while len(self._homes) > MAX_HOMES:
            self._homes.popitem(last=False)
        return self._decided(replica, decision)

    def pick_by_prefix(
        self, block_hashes: Sequence[bytes], loads: dict[int, int]
    ) -> tuple[int, str]:
        """The replica for a request without a key, by its prompt's chained block hashes
        (first block first). Raises ValueError when no replica is live."""
        least = _least(loads)
        best, matched = least, 0
        for replica in sorted(loads, key=lambda r: (loads[r], r)):  # ties: the less loaded
            n = self.matched_blocks(replica, block_hashes)
            if n > matched:
                best, matched = replica, n
        if matched >= self.min_prefix_blocks and loads[best] <= loads[least] + self.threshold:
            decision, replica = PREFIX, best
        else:
            decision, replica = BALANCED, least
        self._routed.setdefault(replica, set()).update(block_hashes)
        return self._decided(replica, decision)

    def matched_blocks(self, replica: int, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt the replica is known to hold."""
        held = self._held.get(replica, set())
        routed = self._routed.get(replica, set())
        n = 0
        for h in block_hashes:  # chained hashes: a block matches only after its parents
            if h not in held and h not in routed:
                break
            n += 1
        return n

    def publish(self, replica: int, block_hashes: Iterable[bytes]) -> None:
        """A replica's heartbeat: the blocks it holds now replace what was known."""
        self._held[replica] = set(block_hashes)
        self._routed.pop(replica, None)

    def update(self, replica: int, cached: Iterable[bytes], dropped: Iterable[bytes]) -> None:
        """A replica's heartbeat as a change: blocks it cached and let go since its last."""
        held = self._held.setdefault(replica, set())
        held.difference_update(dropped)
        held.update(cached)
        self._routed.pop(replica, None)

    def drop(self, replica: int) -> None:
        """A replica went away: what it held went with it."""
        self._held.pop(replica, None)
        self._routed.pop(replica, None)

    def forget(self, key: str) -> None:
        self._homes.pop(key, None)

    def _decided(self, replica: int, decision: str) -> tuple[int, str]:
        self.decisions[decision] += 1
        return replica, decision


def _least(loads: dict[int, int]) -> int:
    if not loads:
        raise ValueError("no live replica")
    return min(loads, key=lambda r: (loads[r], r))
