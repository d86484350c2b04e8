"""A Redis server as the tier (redis-py): shared by every Parley process that reaches it,
so a conversation's K/V follows it to another process or machine.

Keys are `parley:kv:<model fingerprint>:<block hash>`, each with a TTL (refreshed when
loaded); Redis's own maxmemory (with an LRU policy) bounds the rest. Every command has a
timeout. When Redis cannot be reached the tier says so once in the log, answers
"unavailable" at once (no waiting on a dead socket) and the store worker's probe
reconnects it when Redis is back. The URL may hold a password: only `name` (redacted) is
ever logged or exported.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from app.config import redact_url
from app.kvtier.tier import TierUnavailable, TierUsage

log = logging.getLogger("parley.kvtier")

KEY_PREFIX = "parley:kv"
PROBE_EVERY_S = (1.0, 10.0)  # first retry after 1 s, then backing off to every 10 s
USAGE_EVERY_S = 5.0
# Replies of ~100 MB (a long history) parse ~2x faster with 1 MiB socket reads than with
# redis-py's default 64 KiB (measured: 110 vs 213 ms for 125 blocks on loopback).
SOCKET_READ_BYTES = 1 << 20


class RedisTier:
    """Entries in a Redis server."""

    remote = True

    def __init__(self, url: str, namespace: str, ttl_s: float, timeout_s: float) -> None:
        self.name = redact_url(url)
        self.ttl_s = max(1, int(ttl_s))
        self._prefix = f"{KEY_PREFIX}:{namespace}:".encode()
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            socket_read_size=SOCKET_READ_BYTES,
            # No retries inside redis-py: a dead server must cost one timeout, not three
            # with backoff. We retry ourselves, from the store worker (probe).
            retry=Retry(NoBackoff(), 0),
            health_check_interval=30,
        )
        self._lock = threading.Lock()
        self.generation = 0
        self._down = False
        self._next_probe = 0.0
        self._probe_wait = PROBE_EVERY_S[0]
        self._used_memory = 0
        self._next_usage = 0.0
        if self.probe():
            self._check_maxmemory()

    def _key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    @property
    def available(self) -> bool:
        return not self._down

    def _call(self, what: str, fn):
        if self._down:
            raise TierUnavailable(f"{self.name} is down")
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._went_down(what, exc)
            raise TierUnavailable(f"{self.name}: {type(exc).__name__}") from None

    def _went_down(self, what: str, exc: BaseException) -> None:
        with self._lock:
            if self._down:
                return
            self._down = True
            self.generation += 1
            self._probe_wait = PROBE_EVERY_S[0]
            self._next_probe = time.monotonic() + self._probe_wait
        # Every pooled connection may be dead (a restarted server): start afresh, or the
        # first command on each old one would fail and take the tier down again.
        self._client.connection_pool.disconnect()
        # Once per outage. The exception's class, not its text: that is enough to act on
        # and cannot carry a credential.
        log.warning(
            "KV tier %s unreachable (%s during %s): serving without it, reconnecting by itself",
            self.name,
            type(exc).__name__,
            what,
        )

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        def put() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key, entry in items:
                pipe.set(self._key(key), entry, ex=self.ttl_s)
            # A full Redis (maxmemory with noeviction) refuses some SETs: those blocks are
            # simply not kept, like any cache miss; the others went in.
            pipe.execute(raise_on_error=False)

        self._call("store", put)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        names = [self._key(k) for k in keys]
        values = self._call("load", lambda: self._client.mget(names))
        found = [n for n, v in zip(names, values) if v is not None]
        if found:  # what was just used stays longer (MGET does not touch a TTL)
            pipe = self._client.pipeline(transaction=False)
            for n in found:
                pipe.expire(n, self.ttl_s)
            self._call("load", lambda: pipe.execute(raise_on_error=False))
        return values

    def contains(self, key: bytes) -> bool:
        return bool(self._call("lookup", lambda: self._client.exists(self._key(key))))

    def discard(self, key: bytes) -> None:
        self._call("discard", lambda: self._client.delete(self._key(key)))

    def usage(self) -> TierUsage:
        return TierUsage(self._used_memory, None)

    def probe(self) -> bool:
        """Reconnect if down (no more often than the backoff allows); refresh usage."""
        now = time.monotonic()
        was_down = self._down
        if was_down and now < self._next_probe:
            return False
        if not was_down and now < self._next_usage:
            return True
        try:
            info = self._client.info("memory")
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            if was_down:
                with self._lock:
                    self._probe_wait = min(self._probe_wait * 2, PROBE_EVERY_S[1])
                    self._next_probe = now + self._probe_wait
            else:
                self._went_down("probe", exc)
            return False
        self._used_memory = int(info.get("used_memory", 0))
        self._next_usage = now + USAGE_EVERY_S
        if was_down:
            with self._lock:
                self._down = False
            log.warning("KV tier %s reachable again: using it", self.name)
        return True

    def _check_maxmemory(self) -> None:
        try:
            limit = int(self._client.config_get("maxmemory").get("maxmemory", 0))
        except redis.RedisError:
            return  # CONFIG may be disabled on a managed Redis: nothing to check
        if limit == 0:
            log.warning(
                "KV tier %s: Redis has no maxmemory, so entries accumulate until their "
                "TTL (%d s); set maxmemory and maxmemory-policy allkeys-lru",
                self.name,
                self.ttl_s,
            )

    def close(self) -> None:
        self._client.close()
