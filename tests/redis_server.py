"""A real redis-server (Debian's package) on a free loopback port, for the tests that need
one: the turn journal, the KV tier, the Ray scale-out.

The `redis_server` fixture (tests/conftest.py) gives each test a server of its own, so that
no test sees another's keys and a test may stop it. A test that needs a server it can start
later, or one with a password, builds its own `RedisServer`. CI sets PARLEY_REQUIRE_REDIS=1,
so that a missing redis-server fails instead of skipping.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REDIS_SERVER = "redis-server"


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range.

    Servers here restart on the port they had (Redis after a kill, the fault suite's
    app servers), and while one is down the kernel may hand its port to any outgoing
    connection as the local end when it lies in the ephemeral range: the restart then
    fails with EADDRINUSE (SO_REUSEADDR does not help against a connected socket). A
    port below that range is never chosen by connect()."""
    low = ephemeral_range()[0]
    if low < 4096:  # no room below the range: any free port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low}")


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def redis_or_skip() -> str:
    """The redis-server binary; skips the test where it is absent (fails it in CI)."""
    binary = shutil.which(REDIS_SERVER)
    if binary:
        return binary
    if os.environ.get("PARLEY_REQUIRE_REDIS"):
        pytest.fail("redis-server is missing (apt-get install redis-server)")
    pytest.skip("redis-server is not installed")


class RedisServer:
    """One redis-server process; stop() and start() again keep its port. With a `folder`
    its data persists there (append-only file) across a stop and a start."""

    def __init__(
        self,
        folder: Path | None = None,
        port: int | None = None,
        password: str | None = None,
        extra_args: tuple[str, ...] = (),  # e.g. ("--appendfsync", "always")
    ) -> None:
        self.port = port or free_port()
        self.password = password
        self.extra_args = extra_args
        self.persistent = folder is not None
        self.dir = Path(folder or tempfile.mkdtemp(prefix="parley-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = redis_or_skip()
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes" if self.persistent else "no", "--dir", str(self.dir)]
        if self.password:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def pause(self) -> None:
        """SIGSTOP: it keeps its sockets and reads nothing (a stalled Redis: a long fork, a
        swapped-out host) until resume(); commands sent meanwhile run then."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Kill it (SIGKILL: as abrupt as a crash) and wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one, too
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        if not self.persistent:
            shutil.rmtree(self.dir, ignore_errors=True)
