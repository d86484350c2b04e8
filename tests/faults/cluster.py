"""What the fault suite runs against, and the faults it can inject into it: one real
redis-server (append-only file, fsync on every write, so that a kill loses nothing it
acknowledged) and two `python -m app` servers sharing the journal on it, each on a fixed
port so that clients find it again after a restart.

Faults: Redis paused (SIGSTOP) and resumed, killed (SIGKILL) and restarted; a foreign
entry XADDed to the turn stream; a corrupt record planted pending under a consumer that
does not exist (a server claims it, and must drop it); a server killed (-9) and
restarted; a server stalled (SIGSTOP) past the claim time, so that the other takes its
turns over, and resumed.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from app.engine.request import SamplingParams
from app.server.journal import GROUP
from app.server.journal_records import TurnRecord
from tests.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
KEY = "fault-suite-key"
STREAM = "parley:turns"
SERVERS = ("a", "b")
GREEDY = SamplingParams(temperature=0)


class Cluster:
    def __init__(self, folder: Path, claim_after_s: float, timeout_s: float) -> None:
        self.folder = folder
        self.claim_after_s = claim_after_s
        self.timeout_s = timeout_s
        self.redis = RedisServer(folder / "redis", extra_args=("--appendfsync", "always"))
        self.ports = {name: free_port() for name in SERVERS}
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: list[float] = []  # seconds each (re)start took
        self.failed_starts: list[str] = []
        self.down: set[str] = set()  # servers killed or stalled right now

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self.redis.start()
        for name in SERVERS:
            self._spawn(name)
        for name in SERVERS:
            self._wait_ready(name)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(30)
        self.redis.close()

    def url(self, name: str, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.ports[name]}"

    def _spawn(self, name: str) -> None:
        log = (self.folder / f"server-{name}.log").open("a")
        flags = ["--port", str(self.ports[name]), "--journal", self.redis.url,
                 "--journal-consumer", name, "--journal-required",
                 "--journal-claim-after", str(self.claim_after_s),
                 "--journal-timeout", str(self.timeout_s), "--api-key", KEY,
                 "--kv-cache-size", "96MiB", "--kv-tier", "none", "--threads", "1",
                 "--log-level", "info"]  # fmt: skip
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "app", *flags], cwd=ROOT, stdout=log,
            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self._began = time.monotonic()

    def _wait_ready(self, name: str, timeout: float = 240.0) -> bool:
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            if self.procs[name].poll() is not None:
                break
            try:
                if httpx.get(self.url(name) + "/ready", timeout=2).status_code == 200:
                    self.starts.append(time.monotonic() - began)
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.failed_starts.append(f"server {name} did not start (exit {self.procs[name].poll()})")
        return False

    # -- faults -----------------------------------------------------------------------------

    async def pause_redis(self, seconds: float) -> None:
        self.redis.pause()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.redis.resume()

    async def kill_redis(self, down_s: float) -> None:
        self.redis.stop()
        await asyncio.sleep(down_s)
        await asyncio.to_thread(self.redis.start)

    def foreign_entry(self, rng: random.Random) -> None:
        fields = {f"f{i}": rng.choice(["hello", "world", "{}", "[1]", ""]) for i in range(3)}
        redis.Redis.from_url(self.redis.url).xadd(STREAM, fields)

    def corrupt_entry(self, rng: random.Random, n: int) -> None:
        """A record no server can take up, pending under a consumer that is gone."""
        header = TurnRecord("default", "tenant:default", f"ghost-{n}", "t", [], GREEDY, True,
                            None, [1, 2]).to_json()  # fmt: skip
        bad = rng.choice([
            ["[1, 2]"], ["{oops"], ['{"v": 1}'], [header, "[0]"],
            [header, '{"s": "x", "t": "", "i": []}'], [header, '{"s": 0, "t": 1, "i": []}'],
            [header.replace('"prompt":[1,2]', '"prompt":"12"')], [],
        ])  # fmt: skip
        r = redis.Redis.from_url(self.redis.url)
        key = f"parley:rec:ghost-{n}"
        if bad:
            r.rpush(key, *bad)
        r.xadd(STREAM, {"rec": key, "v": 1})
        # Delivered to the ghost (with any foreign entry not yet skipped): a server claims
        # it once it is idle past claim_after.
        r.xreadgroup(GROUP, f"ghost-{n}", {STREAM: ">"})

    async def kill_server(self, name: str) -> None:
        self.down.add(name)
        try:
            proc = self.procs[name]
            proc.kill()
            proc.wait(30)
            self._spawn(name)
            await asyncio.to_thread(self._wait_ready, name)
        finally:
            self.down.discard(name)

    async def stall_server(self, name: str, seconds: float) -> None:
        self.down.add(name)
        proc = self.procs[name]
        proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            proc.send_signal(signal.SIGCONT)
            self.down.discard(name)

    # -- what the servers say ---------------------------------------------------------------

    def metric(self, name: str, metric: str) -> float | None:
        try:
            text = httpx.get(self.url(name) + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith(f"parley:{metric} "):
                return float(line.split()[1])
        return None

    async def journal_up_everywhere(self, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ups = await asyncio.gather(*(asyncio.to_thread(self.metric, n, "journal_up")
                                         for n in SERVERS))  # fmt: skip
            if all(u == 1.0 for u in ups):
                return True
            await asyncio.sleep(0.2)
        return False

    def log_counts(self) -> dict[str, int]:
        """What the servers' journals said they did, from their logs (counters in /metrics
        start from 0 at each restart)."""
        said = {
            "taken over from a stalled server": "taken over by another process",
            "bad entries dropped": "dropping it",
            "foreign entries skipped": "not ours",
            "lost accepts settled": "settled it",
            "Redis outages noticed": "is unreachable",
        }
        text = "".join(p.read_text() for p in self.folder.glob("server-*.log"))
        return {what: text.count(needle) for what, needle in said.items()}

    def pending(self) -> int:
        return redis.Redis.from_url(self.redis.url).xpending(STREAM, GROUP)["pending"]
