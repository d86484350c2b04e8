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
  /proc/thread-self/schedstat: look down), and how much CPU time *other* processes took
  in our affinity set (its busy time in /proc/stat less our own; a niced process's time
  counts as free, it yields to us): where they leave room for one more thread, look up.
  Neither decides anything.
- The decision is measured: a probe runs a few steps at the other count and compares their
  speed (the cost model's predicted seconds per measured second) with the steps just
  before; the faster count stays. A probe that loses backs off (1 s, 2 s, ... 32 s); one
  whose first step already ran at under half the speed ends there. That matters: beside a
  busy neighbour a step at two threads ran 25-50x slower than at one (every barrier waits
  for a time slice), so a probe of six such steps stalled every stream for seconds.
- Below the ceiling a probe up also comes unasked, rarely (8 s, 16 s, ... 64 s apart), in
  case the neighbours leave room the counters do not show. Room appearing where there was
  none is news: it probes at once, whatever the backoff of the probes that lost before.

So a quiet machine never probes (no run delay at the ceiling), a neighbour arriving is seen
within about a second, and its leaving too (its CPU time goes).
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
ROOM = 0.6  # other processes leave this much of a core beyond our threads: look up
SUSTAINED = 2  # samples in a row a signal must hold
SLOWED = 0.5  # ... or one, where the steps run at under this fraction of their usual speed
PROBE_STEPS = 6  # steps measured at the other count (and compared with as many before)
MIN_GAIN = 0.10  # a count must be this much faster to replace the current one
MIN_SWITCH_S = 1.0  # the count changes at most once this often
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # after probes that lost, in a row
ABORT = 0.5  # a probe step under this fraction of the speed before ends the probe, lost
IDLE_GAP_S = 0.02  # steps this far apart (and 2x the last) are not back to back: it was idle
ALIKE = 2.0  # steps compared are within this factor of each other's predicted seconds
UNASKED_S = (8.0, 16.0, 32.0, 64.0)  # probes up with no room seen, after losses in a row


@dataclass(frozen=True)
class Ceiling:
    """The most threads worth running, and why."""

    threads: int
    why: str
    cpus: int = 0  # CPUs in the affinity mask (0: as many as threads)

    def __post_init__(self) -> None:
        if self.cpus < self.threads:
            object.__setattr__(self, "cpus", self.threads)


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
    mask, why = cpus, f"{cpus} CPUs in the affinity mask"
    quota = cgroup_quota(cgroup_root, proc_cgroup)
    if quota is not None and math.ceil(quota) < cpus:
        cpus, why = max(1, math.ceil(quota)), f"{why}, cgroup quota {quota:g} CPUs"
    if at_most is not None and at_most < cpus:
        cpus, why = at_most, f"{why}, a share of {at_most}"
    return Ceiling(max(1, cpus), why, mask)


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
    others: float  # CPU time other processes took on the CPUs of our affinity set


class ProcMachine:
    """MachineSample from Linux's /proc, for the thread that calls `read` (the engine's)."""

    def __init__(self, cpus: set[int] | None = None) -> None:
        try:
            self.cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        except (AttributeError, OSError):
            self.cpus = set()
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        # A niced neighbour yields to us, so its time counts as free; unless we are niced too.
        self._niced = (
            os.getpriority(os.PRIO_PROCESS, 0) > 0 if hasattr(os, "getpriority") else False
        )

    def read(self) -> MachineSample | None:
        try:
            delay_ns = int(Path("/proc/thread-self/schedstat").read_text().split()[1])
            busy_ticks = 0
            for line in Path("/proc/stat").read_text().splitlines():
                name = line.split(maxsplit=1)[0]
                if name.startswith("cpu") and name != "cpu" and int(name[3:]) in self.cpus:
                    # user nice system idle iowait irq softirq steal (guest is in user)
                    ticks = [int(f) for f in line.split()[1:9]]
                    busy_ticks += (
                        sum(ticks) - ticks[3] - ticks[4] - (0 if self._niced else ticks[1])
                    )
            mine = os.times()
        except (OSError, ValueError, IndexError):
            return None
        others = busy_ticks / self._hz - (mine.user + mine.system)
        return MachineSample(time.monotonic(), delay_ns / 1e9, others)


@dataclass
class _Probe:
    count: int
    before: float  # speed of the steps before it, at the current count
    typical: float  # their mean predicted seconds: unlike steps are not measured
    why: str  # "pressure", "room" or "unasked"
    unlike: int = 0
    work: float = 0.0  # measured steps (the first one left out)
    seconds: float = 0.0
    steps: int = 0
    all_work: float = 0.0  # every step, the first one too: for ending a hopeless probe
    all_seconds: float = 0.0


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
        self._last_end = -math.inf  # when the last step ended, and what it took
        self._last_seconds = 0.0
        self._pressure = 0  # samples in a row with run delay over PRESSURE
        self._usual: dict[int, float] = {}  # speed by count, while no pressure was seen
        self._room = 0  # samples in a row where others leave room for one more thread
        self._room_news = False  # room seen after a probe up that lost without it
        self._probe: _Probe | None = None
        self._settle = 0.0  # no probe before this: a count holds at least MIN_SWITCH_S
        # Probes that lost in a row, and when the next may come, by why they would run.
        self._losses = {"pressure": 0, "room": 0, "unasked": 0}
        self._next = {"pressure": 0.0, "room": 0.0, "unasked": math.inf}
        self._unmeasured = False

    def threads(self) -> int:
        """The count the next step runs with."""
        return self._probe.count if self._probe is not None else self.current

    def observe(self, work: float, seconds: float) -> None:
        """The last step: `work` its predicted seconds (any steady unit), `seconds` taken."""
        now = self._clock()
        if seconds <= 0 or work <= 0:
            return
        gap = now - seconds - self._last_end
        idle = gap > max(IDLE_GAP_S, 2 * self._last_seconds)
        self._last_end, self._last_seconds = now, seconds
        if idle:
            # The first step after the engine waited for work pays for waking its threads
            # (and the caches it lost): it neither measures a probe nor sets a baseline.
            if self._probe is not None:
                self._undecided(self._probe, now)
            self._recent.clear()
            return
        if self._probe is not None:
            self._measure_probe(work, seconds, now)
            return
        self._recent.append((work, seconds))
        del self._recent[:-PROBE_STEPS]
        if now >= self._next_sample:
            self._next_sample = now + SAMPLE_S
            self._sample()
        if now < self._settle or len(self._recent) < PROBE_STEPS:
            return
        works = [w for w, _ in self._recent]
        if max(works) > ALIKE * min(works):
            return  # unlike steps (a prompt chunk among decodes): no fair baseline yet
        speed, usual = _speed(self._recent), self._usual.get(self.current)
        if self._pressure == 0:
            self._usual[self.current] = speed if usual is None else 0.9 * usual + 0.1 * speed
        # Steps at half their usual speed while the engine waits for a CPU: one sample of
        # the wait is enough to look (a busy neighbour costs every step from its start).
        slowed = usual is not None and speed < SLOWED * usual
        pressed = self._pressure >= SUSTAINED or (self._pressure >= 1 and slowed)
        below = self.current < self.ceiling.threads
        if pressed and self.current > 1 and now >= self._next["pressure"]:
            self._start_probe(-1, "pressure")
        elif below and self._room >= SUSTAINED and (self._room_news or now >= self._next["room"]):
            self._start_probe(1, "room")
        elif below and now >= self._next["unasked"]:
            self._start_probe(1, "unasked")

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
        others = (sample.others - last.others) / wall
        self._pressure = self._pressure + 1 if waited >= PRESSURE else 0
        room = self.ceiling.cpus - others - self.current >= ROOM
        if room and self._room == 0 and self._losses["room"] == 0:
            self._room_news = True  # the probes up that lost, lost without it
        self._room = self._room + 1 if room else 0

    # -- probes ----------------------------------------------------------------------------

    def _start_probe(self, direction: int, why: str) -> None:
        work = sum(w for w, _ in self._recent) / len(self._recent)
        self._probe = _Probe(self.current + direction, _speed(self._recent), work, why)
        self.stats.probes += 1
        self._pressure = self._room = 0
        self._room_news = False

    def _measure_probe(self, work: float, seconds: float, now: float) -> None:
        probe = self._probe
        assert probe is not None
        if not probe.typical / ALIKE <= work <= probe.typical * ALIKE:
            # Unlike the steps it is compared with: the cost model's error would weigh in.
            # Only a hopeless one ends the probe; too many and the probe ends undecided.
            probe.unlike += 1
            if work / seconds < ABORT / ALIKE * probe.before:
                self._end_probe(probe, work / seconds, now)
            elif probe.unlike > 2 * PROBE_STEPS:
                self._undecided(probe, now)
            return
        probe.steps += 1
        probe.all_work += work
        probe.all_seconds += seconds
        if probe.all_work / probe.all_seconds < ABORT * probe.before:
            self._end_probe(probe, probe.all_work / probe.all_seconds, now)  # hopeless: stop
            return
        if probe.steps == 1:
            return  # the first step at a new count pays for waking (or parking) a thread
        probe.work += work
        probe.seconds += seconds
        if probe.steps > PROBE_STEPS:
            self._end_probe(probe, probe.work / probe.seconds, now)

    def _end_probe(self, probe: _Probe, speed: float, now: float) -> None:
        self._probe = None
        self._recent.clear()
        gain = speed / probe.before
        log.debug("threads: probe %d -> %d (%s): %.2fx in %d steps",
                  self.current, probe.count, probe.why, gain, probe.steps)  # fmt: skip
        if gain >= 1 + MIN_GAIN:
            up = probe.count > self.current
            why = f"{gain:.2f}x the speed of {self.current} " + (
                "(a core freed)" if up else "(a CPU contended)"
            )
            self._switch(probe.count, now, why)
            self._settle = now + MIN_SWITCH_S
            for kind in ("room", "unasked") if up else ("pressure",):
                self._losses[kind] = 0
                self._next[kind] = 0.0
            # Below the ceiling now: probe up unasked, rarely, in case room comes unseen.
            self._next["unasked"] = math.inf if up else now + UNASKED_S[0]
            return
        lost = self._losses[probe.why]
        self._losses[probe.why] = lost + 1
        waits = UNASKED_S if probe.why == "unasked" else BACKOFF_S
        self._next[probe.why] = now + waits[min(lost, len(waits) - 1)]

    def _undecided(self, probe: _Probe, now: float) -> None:
        """A probe cut short before it could compare: it waits as a lost one would, but
        its loss is not counted."""
        self._probe = None
        self._recent.clear()
        waits = UNASKED_S if probe.why == "unasked" else BACKOFF_S
        self._next[probe.why] = now + waits[min(self._losses[probe.why], len(waits) - 1)]

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
