"""The thread policy (app.engine.threads) on a fake clock and a fake machine: it finds the
faster count when a CPU is contended, comes back when it is freed, never probes on a
quiet machine, and never flips faster than its bound."""

from __future__ import annotations

import itertools

import pytest

from app.engine import threads as th
from app.engine.threads import Ceiling, MachineSample, ThreadPolicy, cgroup_quota, read_ceiling

STEP_WORK = 0.008  # predicted seconds of a decode step


class World:
    """Two cores; our step's time by thread count and whether a neighbour spins on one of
    them; the kernel's counters as /proc would show them."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = False
        self.run_delay = 0.0
        self.idle = 0.0
        self.readable = True

    def step_seconds(self, threads: int) -> float:
        if not self.busy:
            return STEP_WORK * (1.0 if threads == 2 else 1.7)
        return STEP_WORK * (10.0 if threads == 2 else 1.75)

    def advance(self, seconds: float, threads: int) -> None:
        self.now += seconds
        if self.busy and threads == 2:  # three runnable threads on two cores
            self.run_delay += seconds / 3
        if not self.busy and threads == 1:  # one core left idle
            self.idle += seconds * 0.95

    def sample(self) -> MachineSample | None:
        return MachineSample(self.now, self.run_delay, self.idle) if self.readable else None


def run(policy: ThreadPolicy, world: World, seconds: float) -> list[int]:
    """Steps back to back for `seconds` of fake time; the count each ran with."""
    counts = []
    end = world.now + seconds
    while world.now < end:
        n = policy.threads()
        took = world.step_seconds(n)
        world.advance(took, n)
        policy.observe(STEP_WORK, took)
        counts.append(n)
    return counts


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture
def policy(world: World) -> ThreadPolicy:
    return ThreadPolicy(Ceiling(2, "test"), machine=world.sample, clock=lambda: world.now)


def test_a_quiet_machine_never_probes(policy, world):
    counts = run(policy, world, 120.0)
    assert set(counts) == {2}
    assert policy.stats.probes == 0 and policy.stats.changes == 0


def test_a_busy_neighbour_is_found_and_one_thread_kept(policy, world):
    run(policy, world, 5.0)
    world.busy = True
    counts = run(policy, world, 10.0)
    assert policy.current == 1 and policy.stats.changes == 1
    # Found within about a second: signals sustained over two samples, then one probe.
    at = next(i for i, n in enumerate(counts) if n == 1)
    assert sum(world.step_seconds(n) for n in counts[:at]) < 1.5
    assert "contended" in policy.stats.last_change


def test_it_comes_back_when_the_neighbour_leaves(policy, world):
    world.busy = True
    run(policy, world, 5.0)
    assert policy.current == 1
    world.busy = False
    counts = run(policy, world, 5.0)
    assert policy.current == 2 and policy.stats.changes == 2
    at = next(i for i, n in enumerate(counts) if n == 2)
    assert sum(world.step_seconds(n) for n in counts[:at]) < 1.5
    assert "freed" in policy.stats.last_change
    assert [n for _, n in policy.stats.history] == [1, 2]


def test_a_probe_that_loses_backs_off(world):
    """Run delay without a faster alternative (say, our own other threads): the probe
    loses, and the next ones come 1 s, 2 s, 4 s ... later, never more often."""
    world.busy = True
    world.step_seconds = lambda threads: STEP_WORK * 3.0  # one thread no faster than two
    policy = ThreadPolicy(Ceiling(2, "test"), machine=world.sample, clock=lambda: world.now)
    counts = run(policy, world, 40.0)
    assert policy.current == 2 and policy.stats.changes == 0
    probes = policy.stats.probes
    assert 3 <= probes <= 7  # 1 + 2 + 4 + 8 + 16 s of backoff in 40 s, with no probe between
    assert counts.count(1) == probes * (th.PROBE_STEPS + 1)


def test_the_count_never_flips_faster_than_the_bound():
    """A neighbour that comes and goes faster than the policy can follow: switches stay at
    least MIN_SWITCH_S apart, however often the signals change."""
    for period in (0.3, 0.6, 0.9, 1.2):
        world = World()
        policy = ThreadPolicy(Ceiling(2, "test"), machine=world.sample, clock=lambda w=world: w.now)
        for _ in range(60):
            world.busy = not world.busy
            run(policy, world, period)
        times = [t for t, _ in policy.stats.history]
        assert all(b - a >= th.MIN_SWITCH_S for a, b in itertools.pairwise(times)), period
        if period >= 0.9:
            assert policy.stats.changes >= 20, period  # it does follow a slower one


def test_an_os_that_says_nothing_keeps_the_ceiling(world):
    world.readable = False
    world.busy = True
    policy = ThreadPolicy(Ceiling(2, "test"), machine=world.sample, clock=lambda: world.now)
    assert set(run(policy, world, 10.0)) == {2}


def test_one_cpu_has_nothing_to_choose(world):
    world.busy = True
    policy = ThreadPolicy(Ceiling(1, "test"), machine=world.sample, clock=lambda: world.now)
    assert set(run(policy, world, 10.0)) == {1} and policy.stats.probes == 0


def test_the_ceiling_is_the_affinity_mask_capped_by_the_cgroup_quota(tmp_path):
    root = tmp_path / "cgroup"
    (root / "user.slice" / "app").mkdir(parents=True)
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/user.slice/app\n")
    eight = lambda: set(range(8))  # noqa: E731
    assert read_ceiling(affinity=eight, cgroup_root=root, proc_cgroup=proc).threads == 8
    (root / "user.slice" / "cpu.max").write_text("150000 100000\n")  # --cpus=1.5, a parent
    (root / "user.slice" / "app" / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(root, proc) == 1.5
    ceiling = read_ceiling(affinity=eight, cgroup_root=root, proc_cgroup=proc)
    assert ceiling.threads == 2 and "quota 1.5" in ceiling.why
    assert read_ceiling(1, affinity=eight, cgroup_root=root, proc_cgroup=proc).threads == 1
    assert read_ceiling(affinity=lambda: {3}, cgroup_root=root, proc_cgroup=proc).threads == 1
    proc.write_text("12:cpu:/legacy\n")  # cgroup v1 only: no quota read
    assert cgroup_quota(root, proc) is None


def test_it_comes_back_even_where_a_freed_core_never_looks_idle(policy, world):
    """Other work soaks up the freed core's slack (no idle time to see): the unasked probes
    up still find that the ceiling is faster again, within a few seconds."""
    world.busy = True
    run(policy, world, 5.0)
    assert policy.current == 1
    world.busy = False
    world.advance = lambda seconds, threads: setattr(world, "now", world.now + seconds)
    counts = run(policy, world, 10.0)
    assert policy.current == 2
    at = next(i for i, n in enumerate(counts) if n == 2)
    assert sum(world.step_seconds(n) for n in counts[:at]) < 5.0


def test_under_lasting_contention_the_probes_up_back_off(policy, world):
    world.busy = True
    counts = run(policy, world, 120.0)
    assert policy.current == 1 and policy.stats.changes == 1
    # Probes up at 2, 4, 8, 16, 32, 64 s gaps at most: a few, not one a second.
    assert policy.stats.probes <= 8
    assert counts.count(2) / len(counts) < 0.05
