"""Which replica serves a request: conversation affinity, bounded by load.

A request with a routing key (a conversation, an API `user`, or the hash of its prompt's
first tokens) goes to the key's home replica, the one that served it last and so holds
its K/V, unless the home is loaded past the least-loaded replica by more than
`threshold` requests: then it goes to the least-loaded one, which becomes its new home.
A key seen for the first time gets a home by rendezvous hashing, so keys spread evenly
and the same key finds the same replica from any front. (SGLang's cache-aware router and
Ray Serve's prefix-aware one work this way: affinity first, a load bound second.)
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Sequence

AFFINE = "affine"  # to the replica that holds the key's K/V
REBALANCED = "rebalanced"  # its home was too busy (or gone): to the least loaded
BALANCED = "balanced"  # no key: to the least loaded
MAX_HOMES = 100_000


def rendezvous(key: str, candidates: Sequence[int]) -> int:
    """The candidate with the highest hash of (key, candidate): stable as replicas come
    and go (only the keys of a lost replica move)."""
    return max(
        candidates, key=lambda c: hashlib.blake2b(f"{c}:{key}".encode(), digest_size=8).digest()
    )


class Router:
    """Picks replicas and remembers each key's home (bounded, least recently used out)."""

    def __init__(self, threshold: int = 4) -> None:
        self.threshold = threshold
        self._homes: OrderedDict[str, int] = OrderedDict()
        self.decisions: Counter[str] = Counter()

    def pick(self, key: str | None, loads: dict[int, int]) -> tuple[int, str]:
        """The replica for a request and why, among the live ones (`loads`: replica ->
        requests in flight). Raises ValueError when none is live."""
        if not loads:
            raise ValueError("no live replica")
        least = min(loads, key=lambda r: (loads[r], r))
        if key is None:
            decision, replica = BALANCED, least
        else:
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
        self.decisions[decision] += 1
        return replica, decision

    def forget(self, key: str) -> None:
        self._homes.pop(key, None)
