"""Every backend keeps, returns and forgets entries the same way; each also keeps its own
promise (a budget, a restart, a TTL, a password that never shows)."""

import logging
import os

import pytest

from app.config import TierConfig
from app.kvtier.backends import open_tier
from app.kvtier.disk import DiskTier
from app.kvtier.memory import MemoryTier
from app.kvtier.tier import TierUnavailable
from tests.redis_server import RedisServer, redis_or_skip

NS = "ab" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def entry(i: int, size: int = 1000) -> bytes:
    return bytes([i % 256]) * size


@pytest.fixture(params=["memory", "disk", "redis"])
def tier(request, tmp_path):
    if request.param == "memory":
        t = open_tier(TierConfig("memory", size_bytes=1 << 20), NS)
    elif request.param == "disk":
        t = open_tier(TierConfig("disk", str(tmp_path), size_bytes=1 << 20), NS)
    else:
        server = request.getfixturevalue("redis_server")
        namespace = f"{request.node.name}-{os.getpid()}"  # the server is shared
        t = open_tier(TierConfig("redis", server.url), namespace)
    yield t
    t.close()


def test_round_trip(tier):
    assert tier.available
    tier.put_many([(key(i), entry(i)) for i in range(5)])
    got = tier.get_many([key(0), key(9), key(4)])
    assert got == [entry(0), None, entry(4)]
    assert tier.contains(key(3)) and not tier.contains(key(9))
    tier.discard(key(3))
    assert not tier.contains(key(3)) and tier.get_many([key(3)]) == [None]
    tier.put_many([(key(0), entry(7))])  # a key written again holds the new entry
    assert tier.get_many([key(0)]) == [entry(7)]
    assert tier.get_many([]) == []
    assert tier.probe() and tier.usage().bytes > 0


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_the_budget_evicts_the_least_recently_used(kind, tmp_path):
    config = TierConfig(kind, str(tmp_path), size_bytes=3500)
    tier = open_tier(config, NS)
    tier.put_many([(key(i), entry(i)) for i in range(3)])
    assert tier.get_many([key(0)]) == [entry(0)]  # 0 is now the most recently used
    tier.put_many([(key(3), entry(3))])
    assert tier.get_many([key(1)]) == [None]  # the least recently used went
    assert tier.contains(key(0)) and tier.contains(key(2)) and tier.contains(key(3))
    assert tier.usage().bytes == 3000 and tier.usage().blocks == 3
    tier.put_many([(key(9), entry(9, 5000))])  # larger than the whole budget: not kept
    assert not tier.contains(key(9)) and tier.usage().blocks == 3


def test_disk_entries_survive_a_restart_and_namespaces_stay_apart(tmp_path):
    first = DiskTier(tmp_path, NS, 1 << 20)
    first.put_many([(key(i), entry(i)) for i in range(3)])
    (first.root / "ab" / ".tmp-crashed").parent.mkdir(exist_ok=True)
    (first.root / "ab" / ".tmp-crashed").write_bytes(b"half an entry")
    again = DiskTier(tmp_path, NS, 1 << 20)
    assert again.get_many([key(0), key(2)]) == [entry(0), entry(2)]
    assert again.usage().blocks == 3
    assert not (first.root / "ab" / ".tmp-crashed").exists()
    other = DiskTier(tmp_path, "cd" * 16, 1 << 20)  # another model's fingerprint
    assert other.get_many([key(0)]) == [None]
    assert oct(first.root.stat().st_mode & 0o777) == "0o700"  # conversations' K/V


def test_disk_that_cannot_be_written_is_unavailable_not_a_crash(tmp_path):
    tier = DiskTier(tmp_path, NS, 1 << 20)
    (tier.root / key(0).hex()[:2]).write_bytes(b"a file where a folder should be")
    with pytest.raises(TierUnavailable):
        tier.put_many([(key(0), entry(0))])
    assert not tier.contains(key(0)) and tier.usage().bytes == 0


def test_memory_tier_is_thread_safe_under_concurrent_puts_and_gets():
    import threading

    tier = MemoryTier(50_000)

    def writer(base: int) -> None:
        for i in range(300):
            tier.put_many([(key(base + i), entry(i))])

    def reader() -> None:
        for i in range(300):
            tier.get_many([key(i), key(1000 + i)])

    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 1000)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    usage = tier.usage()
    assert usage.bytes <= 50_000 and usage.bytes == 1000 * usage.blocks


def test_redis_keys_carry_the_namespace_and_a_ttl(redis_server):
    import redis

    tier = open_tier(TierConfig("redis", redis_server.url, ttl_s=1000), "fp-namespace")
    tier.put_many([(key(1), entry(1))])
    client = redis.Redis.from_url(redis_server.url)
    name = b"parley:kv:fp-namespace:" + key(1).hex().encode()
    assert client.get(name) == entry(1)
    assert 990 <= client.ttl(name) <= 1000
    client.expire(name, 50)
    tier.get_many([key(1)])  # a load refreshes the TTL
    assert client.ttl(name) > 900
    other = open_tier(TierConfig("redis", redis_server.url), "another-model")
    assert other.get_many([key(1)]) == [None]
    for t in (tier, other):
        t.close()


def test_a_redis_password_never_reaches_a_log_or_a_name(caplog):
    redis_or_skip()
    server = RedisServer(password="s3cret-pw").start()
    try:
        caplog.set_level(logging.INFO)
        tier = open_tier(TierConfig("redis", server.url), NS)
        tier.put_many([(key(1), entry(1))])
        assert tier.get_many([key(1)]) == [entry(1)]
        assert "s3cret-pw" not in tier.name and "***" in tier.name
        server.stop()
        with pytest.raises(TierUnavailable):
            tier.get_many([key(1)])
        wrong = open_tier(TierConfig("redis", server.url.replace("s3cret-pw", "nope")), NS)
        assert not wrong.available
        assert "s3cret-pw" not in caplog.text and "nope" not in caplog.text
        assert "unreachable" in caplog.text
        assert "s3cret-pw" not in repr(TierConfig.parse(server.url))
    finally:
        server.close()


def test_redis_down_at_start_then_up_reconnects(monkeypatch, caplog):
    redis_or_skip()
    from app.kvtier import redis as redis_tier

    monkeypatch.setattr(redis_tier, "PROBE_EVERY_S", (0.05, 0.2))
    server = RedisServer()  # not started yet
    caplog.set_level(logging.WARNING, logger="parley.kvtier")
    tier = open_tier(TierConfig("redis", server.url, timeout_s=0.2), NS)
    try:
        assert not tier.available
        with pytest.raises(TierUnavailable):  # at once: no timeout paid while down
            tier.put_many([(key(1), entry(1))])
        assert caplog.text.count("unreachable") == 1
        server.start()
        import time

        deadline = time.monotonic() + 10
        while not tier.probe():
            assert time.monotonic() < deadline, "the tier did not reconnect"
            time.sleep(0.05)
        assert tier.available and "reachable again" in caplog.text
        tier.put_many([(key(1), entry(1))])
        assert tier.get_many([key(1)]) == [entry(1)]
    finally:
        tier.close()
        server.close()


@pytest.mark.parametrize(
    ("spec", "kind", "location"),
    [
        ("none", "none", ""),
        ("memory", "memory", ""),
        ("memory:64MiB", "memory", ""),
        ("redis://:pw@h:6379/2", "redis", "redis://:pw@h:6379/2"),
        ("/var/cache/kv", "disk", "/var/cache/kv"),
        ("/var/cache/kv:20GiB", "disk", "/var/cache/kv"),
    ],
)
def test_the_flag_parses(spec, kind, location):
    config = TierConfig.parse(spec)
    assert (config.kind, config.location) == (kind, location)
    assert "pw" not in config.describe() and "pw" not in repr(config)


def test_bad_flags_are_refused():
    with pytest.raises(ValueError):
        TierConfig.parse("memcached://h")
    with pytest.raises(ValueError):
        TierConfig.parse("memory:lots")
