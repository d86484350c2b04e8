"""A real redis-server (Debian's package) on a free loopback port, for tests that need one:
the KV tier here; the journal and the Ray scale-out later.

`redis_server` (session-scoped) is shared by every test that only reads and writes keys
(give each test its own key prefix or namespace); a test that stops or kills the server
builds its own `RedisServer`. No persistence, no password unless asked. CI sets
PARLEY_REQUIRE_REDIS=1, so that a missing redis-server fails instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

REDIS_SERVER = "redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; stop() and start() again keep its port."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        self.dir = tempfile.mkdtemp(prefix="parley-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", self.dir]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        """Kill it (SIGKILL: as abrupt as a crash) and wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_or_skip() -> None:
    if shutil.which(REDIS_SERVER):
        return
    if os.environ.get("PARLEY_REQUIRE_REDIS"):
        pytest.fail("redis-server is missing (apt-get install redis-server)")
    pytest.skip("redis-server is not installed")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server shared by the session's tests (keys only: never stop it)."""
    redis_or_skip()
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()
