"""The thread policy (app.engine.threads) on a fake clock and a fake machine: it finds the
faster count when a CPU is contended, comes back when it is freed, never probes on a
quiet machine, never flips faster than its bound, and a probe that is hopeless costs one
step, not six."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time

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
        self.others = 0.0
        self.readable = True

    def step_seconds(self, threads: int) -> float:
        if not self.busy:
            return STEP_WORK * (1.0 if threads == 2 else 1.7)
        return STEP_WORK * (10.0 if threads == 2 else 1.75)

    def advance(self, seconds: float, threads: int) -> None:
        self.now += seconds
        if self.busy and threads == 2:  # three runnable threads on two cores
            self.run_delay += seconds / 3
        # The neighbour takes a core; when it is gone, a client takes a little.
        self.others += seconds * (1.0 if self.busy else 0.1)

    def sample(self) -> MachineSample | None:
        return MachineSample(self.now, self.run_delay, self.others) if self.readable else None


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
    # Found within a sample: the steps slowed to a tenth of their usual speed, so one
    # sample of run delay is enough to probe (two are needed where they did not slow).
    at = next(i for i, n in enumerate(counts) if n == 1)
    assert sum(world.step_seconds(n) for n in counts[:at]) < 1.5 * th.SAMPLE_S
    assert "contended" in policy.stats.last_change


def test_run_delay_without_slower_steps_waits_for_a_second_sample(policy, world):
    """The engine waits for a CPU but its steps run as usual (a short burst elsewhere):
    one sample is not enough to look."""
    world.advance = lambda seconds, threads: (
        setattr(world, "now", world.now + seconds),
        setattr(world, "run_delay", world.run_delay + (seconds / 3 if world.burst else 0.0)),
    )
    world.burst = False
    run(policy, world, 5.0)
    run(policy, world, policy._next_sample - world.now)  # to just after a sample
    world.burst = True
    run(policy, world, th.SAMPLE_S * 0.9)  # one sample's worth of waiting
    world.burst = False
    run(policy, world, 5.0)
    assert policy.stats.probes == 0


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


def test_it_comes_back_even_where_the_counters_never_show_room(policy, world):
    """Something the counters charge to others holds the freed core (work that yields to
    us, say): the rare unasked probes up still find that the ceiling is faster again."""
    world.busy = True
    run(policy, world, 5.0)
    assert policy.current == 1
    world.busy = False
    world.advance = lambda seconds, threads: setattr(world, "now", world.now + seconds)
    world.sample = lambda: MachineSample(world.now, 0.0, world.now)  # a core's worth, always
    policy._machine = world.sample
    counts = run(policy, world, 20.0)
    assert policy.current == 2
    at = next(i for i, n in enumerate(counts) if n == 2)
    assert sum(world.step_seconds(n) for n in counts[:at]) <= th.UNASKED_S[0] + 1.0


def _probe_runs(counts: list[int], count: int) -> list[int]:
    """Lengths of the runs of `count` in counts."""
    return [len(list(g)) for n, g in itertools.groupby(counts) if n == count]


def test_under_lasting_contention_the_probes_up_are_rare_and_cost_one_step(policy, world):
    """Beside the neighbour a step at two threads runs 10x slower here (25-50x measured):
    each probe up ends after its first step, and they come 8, 16, 32, 64 s apart."""
    world.busy = True
    counts = run(policy, world, 120.0)
    assert policy.current == 1 and policy.stats.changes == 1
    ups = _probe_runs(counts[counts.index(1) :], 2)
    assert 2 <= len(ups) <= len(th.UNASKED_S) and set(ups) == {1}
    at_two = sum(world.step_seconds(2) for _ in range(sum(ups)))
    assert at_two / 120.0 < 0.01


def test_after_long_contention_the_neighbour_leaving_is_seen_at_once(policy, world):
    """However many unasked probes lost meanwhile, room appearing is news: no backoff."""
    world.busy = True
    run(policy, world, 300.0)
    assert policy.current == 1
    world.busy = False
    counts = run(policy, world, 5.0)
    assert policy.current == 2
    at = next(i for i, n in enumerate(counts) if n == 2)
    assert sum(world.step_seconds(n) for n in counts[:at]) < 1.5


def test_room_that_does_not_pay_backs_off(world):
    """Room shows, but two threads are no faster (a memory-bound step, say): the probes
    that room asks for back off like any that lose, instead of one a second."""
    world.step_seconds = lambda threads: STEP_WORK * 1.7  # the same at either count
    policy = ThreadPolicy(Ceiling(2, "test"), machine=world.sample, clock=lambda: world.now)
    policy.current = 1
    run(policy, world, 64.0)
    assert policy.current == 1 and policy.stats.changes == 0
    assert 3 <= policy.stats.probes <= 8  # 1 + 2 + 4 + 8 + 16 + 32 s apart


def test_proc_machine_charges_others_not_us():
    """On this machine: a second of our own spinning is not others' time; a second of a
    spinning child process is (whatever else the machine runs, it runs in both windows)."""
    machine = th.ProcMachine()
    if machine.read() is None:
        pytest.skip("no /proc here")

    def others_during(work) -> float:
        first = machine.read()
        work()
        second = machine.read()
        return second.others - first.others

    def spin_here() -> None:
        end = time.process_time() + 1.0
        while time.process_time() < end:
            pass

    def spin_a_child() -> None:
        subprocess.run([sys.executable, "-c", SPIN_ONE_SECOND], check=True)

    ours, theirs = others_during(spin_here), others_during(spin_a_child)
    assert theirs - ours > 0.3, (ours, theirs)


SPIN_ONE_SECOND = (
    "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"
)


def test_unlike_steps_are_not_compared(world):
    """A prompt chunk now and then among decodes, its cost under-predicted 4x, and run
    delay all the while (our own front and client share the cores): one thread is slower,
    and a window with a chunk in it must not make the decodes at one thread look faster."""
    world.advance = lambda seconds, threads: (
        setattr(world, "now", world.now + seconds),
        setattr(world, "run_delay", world.run_delay + seconds / 3),
    )
    policy = ThreadPolicy(Ceiling(2, "test"), machine=world.sample, clock=lambda: world.now)
    for i in itertools.count():
        if world.now > 60.0:
            break
        n = policy.threads()
        chunk = i % 97 == 0  # a new request now and then
        work = STEP_WORK * (5.0 if chunk else 1.0)
        took = world.step_seconds(n) * (20.0 if chunk else 1.0)
        world.advance(took, n)
        policy.observe(work, took)
    assert policy.stats.changes == 0


def test_the_first_step_after_idle_is_no_baseline(world):
    """Short requests with pauses between them; the first step after each pause pays 10x
    for waking the threads, and run delay is seen (our own client shares the cores): that
    step must not make one thread look faster than two."""
    world.advance = lambda seconds, threads: (
        setattr(world, "now", world.now + seconds),
        setattr(world, "run_delay", world.run_delay + seconds * 0.6),
    )
    policy = ThreadPolicy(Ceiling(2, "test"), machine=world.sample, clock=lambda: world.now)
    while world.now < 60.0:
        world.now += 0.05  # the engine waits for the next request
        for i in range(10):
            n = policy.threads()
            took = world.step_seconds(n) * (10.0 if i == 0 else 1.0)
            world.advance(took, n)
            policy.observe(STEP_WORK, took)
    assert policy.stats.changes == 0
