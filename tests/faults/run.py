"""One run of the fault suite: clients keep turns going against the cluster
(tests/faults/cluster.py) while a seeded schedule injects faults, one at a time, each
followed by the system's recovery; then the invariants are checked:

- every accepted turn (its client saw `start`) ends exactly once: one terminal, `done`,
  and where the journal still has its record, that record's end is the very frame;
- what any client saw is a prefix of the turn's record, with no seq gap or repeat (the
  clients check each frame as it comes, and each resume from a random seq);
- no turn refused before its start ran later, and no conversation's history shrank;
- nothing stays pending in the journal once the run is over;
- every server (re)start came up.

The same run serves the test (tests/server/test_fault_suite.py, a CI budget) and the
benchmark (bench/faults.py, longer).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from app.chat.sessions import conversation_key
from app.server.journal_records import JournalEntry, read_record, record_key
from app.server.security import DEFAULT_TENANT
from tests.faults.client import Client, Ledger, Observation
from tests.faults.cluster import SERVERS, Cluster

# Relative weights of the infrastructure faults (client drops come with every turn).
INFRA = {"redis pause": 4, "redis kill": 2, "foreign entry": 2, "corrupt entry": 2,
         "server kill": 1, "server stall": 1}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    seed: int = 0
    duration_s: float = 100.0  # at most; with min_faults: until that many were injected,
    min_faults: int | None = None  # every infrastructure kind among them at least once
    clients: int = 8
    max_tokens: int = 8
    drop_chance: float = 0.8  # per socket a reply streams on
    claim_after_s: float = 3.0
    timeout_s: float = 0.5
    gap_s: tuple[float, float] = (0.2, 1.0)  # between infrastructure faults
    patience_s: float = 120.0  # a turn without a terminal this long is lost


@dataclass
class Report:
    faults: dict[str, int]
    turns: int  # turns sent
    accepted: int
    done: int
    refused: int  # refusals before a start (retried)
    given_up: int  # sent, never seen accepted, asked again under a new id
    starts: list[float]
    violations: list[str] = field(default_factory=list)
    journal: dict[str, int] = field(default_factory=dict)  # what the servers' logs say

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())


async def run(plan: Plan, folder: Path) -> Report:
    cluster = Cluster(folder, plan.claim_after_s, plan.timeout_s)
    await asyncio.to_thread(cluster.start)
    try:
        return await _run(plan, cluster)
    finally:
        cluster.close()


async def _run(plan: Plan, cluster: Cluster) -> Report:
    rng = random.Random(plan.seed)
    ledger = Ledger()
    until = time.monotonic() + plan.duration_s

    def going() -> bool:
        # Client drops come with every turn, and how many come between two infrastructure
        # faults depends on the machine's speed: a count alone could end before a kind of
        # fault came up at all.
        enough = (
            plan.min_faults is not None
            and sum(ledger.faults.values()) >= plan.min_faults
            and all(ledger.faults.get(kind, 0) >= 1 for kind in INFRA)
        )
        return time.monotonic() < until and not enough

    clients = [Client(i, cluster, ledger, random.Random(rng.random()), plan.max_tokens,
                      plan.drop_chance, plan.patience_s) for i in range(plan.clients)]  # fmt: skip
    injector = asyncio.create_task(_inject(plan, cluster, ledger, random.Random(rng.random()),
                                           going))  # fmt: skip
    await asyncio.gather(*(c.run(going) for c in clients))
    await injector
    violations = await _quiesce(cluster)
    violations += _check(cluster, ledger)
    (cluster.folder / "ledger.json").write_text(json.dumps([t.__dict__ for t in ledger.turns],
                                                           default=str, indent=0))  # fmt: skip
    violations += cluster.failed_starts
    turns = ledger.turns
    journal = cluster.log_counts()
    return Report(
        dict(ledger.faults), len(turns), sum(t.accepted for t in turns),
        sum(t.terminal is not None and t.terminal["type"] == "done" for t in turns),
        sum(len(t.refusals) for t in turns), sum(t.given_up for t in turns),
        list(cluster.starts), violations, journal,
    )  # fmt: skip


async def _inject(plan: Plan, cluster: Cluster, ledger: Ledger, rng: random.Random,
                  going) -> None:  # fmt: skip
    kinds, weights = list(INFRA), list(INFRA.values())
    redis_back = 0.0  # when Redis last came back: turns older than that may be unjournaled
    n = 0
    while going():
        await asyncio.sleep(rng.uniform(*plan.gap_s))
        kind = rng.choices(kinds, weights)[0]
        n += 1
        if kind == "redis pause":  # short ones delay calls; long ones time them out
            await cluster.pause_redis(rng.uniform(0.1, 4 * plan.timeout_s))
        elif kind == "redis kill":
            await cluster.kill_redis(rng.uniform(0.1, 1.0))
        elif kind == "foreign entry":
            cluster.foreign_entry(rng)
        elif kind == "corrupt entry":
            cluster.corrupt_entry(rng, n)
        else:
            # A turn that ran through a Redis outage is not durable: it must end before its
            # server may die (docs/journal.md, "What it relies on").
            await _settled(ledger, redis_back + 1.0, 60)
            name = rng.choice(SERVERS)
            if kind == "server kill":
                await cluster.kill_server(name)
            else:
                await cluster.stall_server(name, plan.claim_after_s + rng.uniform(1.0, 2.0))
        ledger.faults[kind] += 1
        if kind.startswith("redis"):
            await cluster.journal_up_everywhere()
            redis_back = time.monotonic()


async def _settled(ledger: Ledger, before: float, timeout: float) -> None:
    """Until every turn sent before `before` has ended (or `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        t.sent_at < before and t.terminal is None and not t.given_up and not t.problems
        for t in ledger.turns
    ):
        await asyncio.sleep(0.2)


async def _quiesce(cluster: Cluster) -> list[str]:
    """Nothing stays pending: once the servers have claimed, dropped and settled what
    the faults left."""
    deadline = time.monotonic() + 4 * cluster.claim_after_s + 20
    while time.monotonic() < deadline:
        if cluster.pending() == 0:
            return []
        await asyncio.sleep(0.5)
    return [f"{cluster.pending()} journal entries still pending after the run"]


def _check(cluster: Cluster, ledger: Ledger) -> list[str]:
    r = redis.Redis.from_url(cluster.redis.url)
    out = []
    for t in ledger.turns:
        name = f"turn {t.conversation}/{t.turn_id}"
        out += [f"{name}: {p}" for p in t.problems]
        items = r.lrange(record_key("parley", conversation_key(DEFAULT_TENANT, t.conversation),
                                    t.turn_id), 0, -1)  # fmt: skip
        record = read_record(JournalEntry("", ""), items) if items else None
        if t.accepted and t.terminal is None and not t.problems:
            out.append(f"{name}: accepted, and never ended")
        if t.terminal is not None and t.terminal["type"] == "error" and t.accepted:
            out.append(f"{name}: ended with {t.terminal['code']}: {t.terminal['message']}")
        if record is None:
            continue  # never journaled (Redis was out), or abandoned: nothing to compare
        out += _against_record(name, t, record)
    return out


def _against_record(name: str, t: Observation, record) -> list[str]:
    out = []
    seen = [t.texts[s] for s in sorted(t.texts)]
    if record.end is not None and record.texts[: len(seen)] != seen:
        out.append(
            f"{name}: what the client saw ({''.join(seen)!r}, from {t.servers}) is "
            f"not a prefix of the record ({''.join(record.texts)!r})"
        )
    elif record.end is None and seen[: len(record.texts)] != record.texts:
        out.append(f"{name}: the record is not a prefix of what the client saw")
    if not t.accepted and record.end is not None and record.ok:
        what = "given up unseen" if t.given_up else f"refused ({', '.join(t.refusals)})"
        if not t.given_up:
            out.append(f"{name}: {what}, and yet it ran to its end")
    done = t.terminal is not None and t.terminal["type"] == "done"
    if done and record.end is not None and json.loads(record.end) != t.terminal:
        out.append(
            f"{name}: the client's done ({t.terminal}) is not the record's end ({record.end})"
        )
    return out
