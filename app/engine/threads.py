"""How many CPU threads the engine computes with now: the ceiling from what this process may
use, the choice from what the machine gives it at the moment.

A step is hundreds of parallel regions (matmuls, norms, attention), each ending in a barrier.
When another process takes a core from one of our threads, every barrier waits for that
thread's next time slice: two threads beside one busy neighbour ran a stream ~10x slower
than one thread alone on the free core. So the count follows the machine:

- The ceiling: the CPUs of our affinity mask, capped by the cgroup's CPU quota
  (`cpu.max`, rounded up), read once at start.
- Two cheap measurements of the machine, sampled a few times a second, say when to look:
  how long the engine thread waited for a CPU while runnable (the kernel's run delay,
  /proc/thread-self/schedstat), and how much CPU time our affinity set left idle
  (/proc/stat). Neither decides anything.
- The decision is measured: a probe runs a few steps at the other count and compares their
  speed (the cost model's predicted seconds per measured second) with the steps just
  before; the faster count stays. A probe that loses backs off (1 s, 2 s, ... 32 s).
  Below the ceiling a probe up also comes unasked, at the same backoff: a freed core need
  not show as idle where other work soaks up its slack.

So a quiet machine never probes (no run delay at the ceiling), a neighbour arriving is seen
within about a second, and its leaving too (a core goes idle while we run fewer threads).
A count changes at most once a MIN_SWITCH_S. `--threads N` pins the count instead.

The clock and the measurements are injected: the tests drive the policy with fakes.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SAMPLE_S = 0.25  # how often the machine is read
PRESSURE = 0.15  # the engine thread waited for a CPU this fraction of the time: look down
IDLE_CORES = 0.6  # this much of a core idle in our set while we run fewer threads: look up
SUSTAINED = 2  # samples in a row a signal must hold
PROBE_STEPS = 6  # steps measured at the other count (and compared with as many before)
MIN_GAIN = 0.10  # a count must be this much faster to replace the current one
MIN_SWITCH_S = 1.0  # the count changes at most once this often
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # after probes that lost, in a row


@dataclass(frozen=True)
class Ceiling:
    """The most threads worth running, and why."""

    threads: int
    why: str


def read_ceiling(
    at_most: int | None = None,
    affinity: Callable[[], set[int]] | None = None,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
) -> Ceiling:
    """CPUs in this process's affinity mask, capped by the cgroup v2 quota (cpu.max of our
    own cgroup and its parents: `docker run --cpus=1.5` sets one there; torch would still
    count every core of the host) and by `at_most` (a replica's share of the machine)."""
    try:
        cpus = len((affinity or (lambda: os.sched_getaffinity(0)))())
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    why = f"{cpus} CPUs in the affinity mask"
    quota = cgroup_quota(cgroup_root, proc_cgroup)
    if quota is not None and math.ceil(quota) < cpus:
        cpus, why = max(1, math.ceil(quota)), f"{why}, cgroup quota {quota:g} CPUs"
    if at_most is not None and at_most < cpus:
        cpus, why = at_most, f"{why}, a share of {at_most}"
    return Ceiling(max(1, cpus), why)


def cgroup_quota(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The tightest cgroup v2 CPU quota on our path, in CPUs (None: no limit, or no v2)."""
    try:
        entries = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rel = next((e.split(":", 2)[2] for e in entries if e.startswith("0::")), None)
    if rel is None:
        return None
    tightest = None
    path = root / rel.lstrip("/")
    while True:
        try:
            limit, period = (path / "cpu.max").read_text().split()[:2]
            if limit != "max":
                cpus = int(limit) / int(period)
                tightest = cpus if tightest is None else min(tightest, cpus)
        except (OSError, ValueError):
            pass
        if path == root or root not in path.parents:
            return tightest
        path = path.parent


@dataclass
class MachineSample:
    """Cumulative counters read at one moment (seconds)."""

    wall: float
    run_delay: float  # the engine thread's time runnable but not running
    idle: float  # idle CPU time, summed over the CPUs of our affinity set


class ProcMachine:
    """MachineSample from Linux's /proc, for the thread that calls `read` (the engine's)."""

    def __init__(self, cpus: set[int] | None = None) -> None:
        try:
            self.cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        except (AttributeError, OSError):
            self.cpus = set()
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def read(self) -> MachineSample | None:
        try:
            delay_ns = int(Path("/proc/thread-self/schedstat").read_text().split()[1])
            idle_ticks = 0
            for line in Path("/proc/stat").read_text().splitlines():
                name = line.split(maxsplit=1)[0]
                if name.startswith("cpu") and name != "cpu" and int(name[3:]) in self.cpus:
                    fields = line.split()
                    idle_ticks += int(fields[4]) + int(fields[5])  # idle + iowait
        except (OSError, ValueError, IndexError):
            return None
        return MachineSample(time.monotonic(), delay_ns / 1e9, idle_ticks / self._hz)


@dataclass
class _Probe:
    count: int
    before: float  # speed of the steps before it, at the current count
    work: float = 0.0
    seconds: float = 0.0
    steps: int = 0


@dataclass
class ThreadStats:
    """What /metrics shows."""

    threads: int
    ceiling: int
    changes: int = 0  # switches made
    probes: int = 0  # probes run, kept or not
    last_change: str = ""
    history: list[tuple[float, int]] = field(default_factory=list)  # (time, count), last 64


class ThreadPolicy:
    """The thread count for the engine's next step. Call `threads()` before a step and
    `observe()` after it, on the engine's thread."""

    def __init__(
        self,
        ceiling: Ceiling,
        *,
        machine: Callable[[], MachineSample | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ceiling = ceiling
        self._machine = machine if machine is not None else ProcMachine().read
        self._clock = clock
        self.current = ceiling.threads
        self.stats = ThreadStats(self.current, ceiling.threads)
        self._recent: list[tuple[float, float]] = []  # (work, seconds) at `current`
        self._last: MachineSample | None = None
        self._next_sample = 0.0
        self._pressure = 0  # samples in a row with run delay over PRESSURE
        self._idle = 0  # samples in a row with an idle core while below the ceiling
        self._probe: _Probe | None = None
        self._not_before = 0.0  # no probe before this (switch bound, backoff)
        self._losses = {-1: 0, 1: 0}  # probes that lost in a row, down and up
        # Below the ceiling, a probe up also comes on its own now and then (backing off
        # like any losing probe): a freed core may not show as idle where other work
        # takes its slack.
        self._retry_up = math.inf
        self._unmeasured = False

    def threads(self) -> int:
        """The count the next step runs with."""
        return self._probe.count if self._probe is not None else self.current

    def observe(self, work: float, seconds: float) -> None:
        """The last step: `work` its predicted seconds (any steady unit), `seconds` taken."""
        now = self._clock()
        if seconds <= 0 or work <= 0:
            return
        if self._probe is not None:
            self._measure_probe(work, seconds, now)
            return
        self._recent.append((work, seconds))
        del self._recent[:-PROBE_STEPS]
        if now >= self._next_sample:
            self._next_sample = now + SAMPLE_S
            self._sample()
        if now < self._not_before or len(self._recent) < PROBE_STEPS:
            return
        if self._pressure >= SUSTAINED and self.current > 1:
            self._start_probe(-1, now)
        elif self.current < self.ceiling.threads and (
            self._idle >= SUSTAINED or now >= self._retry_up
        ):
            self._start_probe(1, now)

    # -- signals ---------------------------------------------------------------------------

    def _sample(self) -> None:
        sample = self._machine()
        if sample is None:
            if not self._unmeasured:
                self._unmeasured = True
                log.info("threads: this OS does not say how busy its CPUs are; staying at %d",
                         self.current)  # fmt: skip
            return
        last, self._last = self._last, sample
        if last is None or sample.wall <= last.wall:
            return
        wall = sample.wall - last.wall
        waited = (sample.run_delay - last.run_delay) / wall
        idle = (sample.idle - last.idle) / wall
        self._pressure = self._pressure + 1 if waited >= PRESSURE else 0
        below = self.current < self.ceiling.threads
        self._idle = self._idle + 1 if below and idle >= IDLE_CORES else 0

    # -- probes ----------------------------------------------------------------------------

    def _start_probe(self, direction: int, now: float) -> None:
        self._probe = _Probe(self.current + direction, _speed(self._recent))
        self.stats.probes += 1
        self._pressure = self._idle = 0

    def _measure_probe(self, work: float, seconds: float, now: float) -> None:
        probe = self._probe
        assert probe is not None
        probe.steps += 1
        if probe.steps == 1:
            return  # the first step at a new count pays for waking (or parking) a thread
        probe.work += work
        probe.seconds += seconds
        if probe.steps <= PROBE_STEPS:
            return
        self._probe = None
        direction = 1 if probe.count > self.current else -1
        speed = probe.work / probe.seconds
        if speed >= probe.before * (1 + MIN_GAIN):
            why = (f"{speed / probe.before:.2f}x the speed of {self.current} "
                   f"({'a core freed' if direction > 0 else 'a CPU contended'})")  # fmt: skip
            self._switch(probe.count, now, why)
            self._losses[direction] = 0
            self._not_before = now + MIN_SWITCH_S
            self._retry_up = now + 2 * BACKOFF_S[0] if direction < 0 else math.inf
        else:
            lost = self._losses[direction]
            self._losses[direction] = lost + 1
            wait = BACKOFF_S[min(lost, len(BACKOFF_S) - 1)]
            self._not_before = now + wait
            if direction > 0:
                self._retry_up = now + 2 * wait
        self._recent.clear()

    def _switch(self, count: int, now: float, why: str) -> None:
        log.info("threads: %d -> %d: %s", self.current, count, why)
        self.current = count
        self.stats.threads = count
        self.stats.changes += 1
        self.stats.last_change = why
        self.stats.history = [*self.stats.history[-63:], (now, count)]


def _speed(steps: list[tuple[float, float]]) -> float:
    """Predicted seconds computed per second measured."""
    return sum(w for w, _ in steps) / max(1e-12, sum(s for _, s in steps))
