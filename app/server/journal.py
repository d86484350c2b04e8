"""The durable turn log on Redis Streams: accepted turns survive a restart of the server.

Layout (namespace `parley` by default):

    parley:turns        a stream; one entry per accepted turn, field `rec` names its record
    group "workers"     the consumer group: an entry is pending under the process running it
    parley:rec:<hash>   the turn's record, a list: header, one item per frame, end
                        (app.server.journal_records)

A turn is appended before it is scheduled, by one script (app.server.journal_scripts,
ACCEPT) that writes its record and entry and delivers that very entry to this process, so it
is pending here from the start. Each token frame is recorded before it is sent
(write-ahead), so whatever a client saw is in the journal and a restart can never show it a
gap or a duplicate; frames of all turns are written together (group commit,
app.server.journal_writes), each write only while the entry is still this process's and
the record as it left it. At the end the record gets its end, the entry is acknowledged
and the record expires after `keep_finished_s` (a resume whose `done` was lost still finds it).

Recovery: at start-up a process takes back the entries still pending under its own name
(a restart of the same server), and every `claim_after_s / 3` it takes over (XAUTOCLAIM)
entries left idle longer than `claim_after_s` by a process that stopped: a live process
refreshes its own entries' idle time as a heartbeat, and never takes its own live turns.
After it lost Redis it claims nothing for `claim_after_s`: a Redis that stalled ages every
entry, and live processes need a heartbeat's time to show they are alive. The stream is
trimmed of acknowledged entries once it holds more than `max_turns`.

Faults: when Redis cannot be reached, turns are served without durability (one log line,
`parley:journal_up` 0), or refused with `unavailable` under `required`. An accept that timed
out either never happens (its deadline passed in Redis) or is settled when Redis is back;
a write that fails is tried again for twice the timeout; then, under `required`, the turn
stops and is taken up again from its record once Redis answers (no frame is ever sent
unrecorded), or else runs on without durability and is abandoned (acknowledged) as soon
as Redis answers; a turn another process took over while this one stalled gets no more
writes from it (`lost`: its runner stops). Entries and records that are not ours, or not
whole, are dropped, logged once and counted. What this relies on is in docs/journal.md.

The engine never knows: this is the server's log of its /ws turns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from app.server import journal_scripts as scripts
from app.server.journal_records import (
    VERSION,
    JournalEntry,
    RecoveredTurn,
    TurnRecord,
    record_key,
)
from app.server.journal_recovery import GROUP, Recovery
from app.server.journal_writes import FrameWriter

log = logging.getLogger(__name__)

__all__ = ["GROUP", "Journal", "JournalConfig", "JournalStats", "JournalUnavailable"]


class JournalUnavailable(RuntimeError):
    """The journal is required and Redis cannot be reached: the turn is refused."""


@dataclass(frozen=True)
class JournalConfig:
    url: str  # redis://host:port/db
    required: bool = False  # refuse turns while Redis is unreachable
    consumer: str = "parley"  # this server's name in the group: keep it across restarts
    namespace: str = "parley"
    claim_after_s: float = 30.0  # a process silent this long loses its turns to others
    max_turns: int = 10_000  # stream entries before acknowledged ones are trimmed
    keep_finished_s: float = 600.0  # a finished turn's record stays this long
    timeout_s: float = 2.0  # one Redis call, at most


@dataclass(frozen=True)
class JournalStats:
    """Counters for /metrics."""

    up: bool
    turns: int  # turns journaled
    unjournaled: int  # turns served without durability (Redis unreachable)
    writes: int  # frames recorded
    write_errors: int
    flushes: int  # round trips that recorded frames (group commits)
    flush_seconds: float  # their total time
    recovered: int  # turns taken over (from an earlier life or a silent process)
    skipped: int = 0  # entries not ours, skipped on the way to our own
    dropped: int = 0  # entries dropped: no record, or one not ours or not whole
    taken_over: int = 0  # turns of this process another took over while it stalled
    settled: int = 0  # accepts that timed out but had happened, cleared up


@dataclass(frozen=True)
class _Unsure:
    """An accept whose answer never came: it may have happened (SETTLE clears it up)."""

    nonce: str
    record_key: str
    settle_after: float  # time.monotonic(): past the deadline it carried, by any clock


class Journal(Recovery):
    """One process's side of the journal."""

    def __init__(self, config: JournalConfig) -> None:
        self.config = config
        self.stream = f"{config.namespace}:turns"
        self._redis = aioredis.Redis.from_url(
            config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s
        )
        self._scripts = [self._redis.register_script(s) for s in scripts.ALL]
        (self._accept, self._write_one, self._settle, self._abandon, self._heartbeat,
         self._trim) = self._scripts  # fmt: skip
        self._writer = FrameWriter(self._redis, self._write_one, self.stream, GROUP,
                                   config.consumer, self._lose,
                                   lambda exc: self._set_up(False, exc))  # fmt: skip
        self.up = False
        self._said_down = False
        self._clock_ms: float | None = None  # Redis's clock minus ours
        self._claims_from = 0.0  # time.monotonic(): no claims before (after a lost Redis)
        self._live: dict[str, JournalEntry] = {}  # entry id -> in flight here
        self._abandoned: list[JournalEntry] = []  # to acknowledge once Redis is back
        self._unsure: list[_Unsure] = []
        self._released: list[JournalEntry] = []  # to take up again once Redis answers
        self._counts = dict(turns=0, unjournaled=0, recovered=0, skipped=0, dropped=0,
                            taken_over=0, settled=0)  # fmt: skip

    # -- start-up and maintenance ------------------------------------------------------------

    async def open(self) -> list[RecoveredTurn]:
        """Connect, and take back the turns pending under this process's name (its own,
        from before a restart). Redis down: [] (turns run without durability)."""
        try:
            await self._connect()
            return await self._take_back()
        except RedisError as exc:
            self._set_up(False, exc)
            return []

    async def maintain(self) -> list[RecoveredTurn]:
        """One round of housekeeping: reconnect, settle, heartbeat, trim, and take over
        turns of silent processes (returned, to be resumed)."""
        try:
            if not self.up:
                await self._connect()
            await self._settle_unsure()
            await self._settle_abandoned()
            if self._live:
                ids = list(self._live)
                _, taken = await self._heartbeat([self.stream],
                                                 [GROUP, self.config.consumer, *ids])  # fmt: skip
                for lost in (_text(i) for i in taken):
                    entry = self._live.get(lost)
                    if entry is not None:  # None: it finished meanwhile
                        self._lose(entry)
            await self._trim([self.stream], [GROUP, self.config.max_turns])
            taken = await self._take_back_released() if self._released else []
            return taken + await self._claim_stale()
        except RedisError as exc:
            self._set_up(False, exc)
            return []

    async def close(self) -> None:
        await self._writer.close()
        await self._redis.aclose()

    async def _connect(self) -> None:
        try:
            await self._redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        for script in self._scripts:  # loaded now: no call of a turn waits for a load
            script.sha = await self._redis.script_load(script.script)
        before = time.time()
        seconds, micros = await self._redis.time()
        self._clock_ms = seconds * 1e3 + micros / 1e3 - (before + time.time()) * 500
        if self._said_down:  # Redis was lost: live processes need a heartbeat's time
            self._claims_from = time.monotonic() + self.config.claim_after_s
        self._set_up(True)

    async def _settle_unsure(self) -> None:
        now = time.monotonic()
        for unsure in [u for u in self._unsure if u.settle_after <= now]:
            found = await self._settle([self.stream, unsure.record_key],
                                       [GROUP, self.config.consumer, unsure.nonce])  # fmt: skip
            if found:
                log.warning("journal: an accept that timed out had happened; settled it")
                self._counts["settled"] += 1
            self._unsure.remove(unsure)

    async def _settle_abandoned(self) -> None:
        while self._abandoned:
            entry = self._abandoned[-1]
            await self._abandon([self.stream, entry.record_key],
                                [GROUP, self.config.consumer, entry.entry_id, entry.nonce,
                                 ""])  # fmt: skip
            self._live.pop(entry.entry_id, None)  # no heartbeat for it from now on
            self._abandoned.pop()

    def _give_up(self, entry: JournalEntry) -> None:
        """A turn lost a write: it runs on without durability, and is abandoned (its
        entry acknowledged, its record deleted) as soon as Redis answers, so that nobody
        takes it up later. Until then the heartbeat keeps it ours."""
        entry.durable = False
        if not entry.abandoned and not entry.lost:
            entry.abandoned = True
            self._abandoned.append(entry)

    def _lose(self, entry: JournalEntry) -> None:
        if not entry.lost:
            log.warning("journal: turn %s was taken over by another process while this one "
                        "stalled; this one stops it", entry.entry_id)  # fmt: skip
            self._counts["taken_over"] += 1
        entry.lost = True
        self._live.pop(entry.entry_id, None)

    # -- a turn's writes ---------------------------------------------------------------------

    async def accept(self, record: TurnRecord, conversation_key: str) -> JournalEntry | None:
        """Append a turn before it is scheduled. None: Redis is unreachable and the turn
        runs without durability. Raises JournalUnavailable instead when required."""
        if self.up:
            key = record_key(self.config.namespace, conversation_key, record.turn_id)
            nonce = uuid.uuid4().hex
            sent = time.monotonic()
            # Redis runs it only within half the timeout: the other half is for the answer.
            deadline = "" if self._clock_ms is None else str(
                int(time.time() * 1e3 + self._clock_ms + self.config.timeout_s * 500))  # fmt: skip
            args = [GROUP, self.config.consumer, record.to_json(nonce), VERSION, nonce, deadline]
            try:
                reply = await self._accept([self.stream, key], args)
            except RedisError as exc:
                # It may still run, or have run: settled once Redis answers again.
                self._unsure.append(_Unsure(nonce, key, sent + self.config.timeout_s))
                self._set_up(False, exc)
            else:
                if reply:
                    entry = JournalEntry(_text(reply[0]), key, nonce=nonce)
                    self._counts["skipped"] += int(reply[1])
                    if reply[1]:
                        log.warning("journal: skipped %d entries that were not ours", reply[1])
                    self._live[entry.entry_id] = entry
                    self._counts["turns"] += 1
                    return entry
                log.warning("journal: Redis ran an accept after its deadline; not journaled")
        if self.config.required:
            raise JournalUnavailable(
                "the turn journal is unreachable, and this server serves no turn without "
                "it: retry shortly"
            )
        self._counts["unjournaled"] += 1
        return None

    async def progress(
        self,
        entry: JournalEntry,
        seq: int,
        text: str,
        token_ids: list[int],
        start: tuple[int, ...] | None = None,
    ) -> bool:
        """Record token frame `seq` (and the output ids since the last record) before it
        is sent. False: not recorded (the turn is no longer durable, or `entry.lost`)."""
        item: dict[str, Any] = {"s": seq, "t": text, "i": token_ids}
        if start is not None:
            item["start"] = list(start)
        return await self._write(entry, [_dump(item)], ttl=0, frames=1)

    async def finish(
        self, entry: JournalEntry, terminal: str | None, ok: bool, token_ids: list[int]
    ) -> None:
        """The turn is over: record its end, acknowledge it, let the record expire."""
        if entry.durable and not entry.lost:
            end = _dump({"end": terminal, "ok": ok, "i": token_ids})
            if await self._write(entry, [end], ttl=int(self.config.keep_finished_s)):
                self._live.pop(entry.entry_id, None)
                return
        if entry.lost:
            self._live.pop(entry.entry_id, None)  # another process ends it
        elif not entry.released:  # (released: taken up again, and ended, from its record)
            self._give_up(entry)  # ends once Redis answers

    def release(self, entry: JournalEntry) -> None:
        """Leave a turn pending (shutdown): the next process resumes it."""
        self._live.pop(entry.entry_id, None)

    async def _write(self, entry: JournalEntry, items: list[str], ttl: int, frames=0) -> bool:
        """Write-ahead: True once `items` are in the record. When Redis fails, it is tried
        again for twice the call timeout (at most half the claim time: the reply waits, its
        outputs merging); past that the turn is released (`required`: it stops here and is
        taken up again from its record once Redis answers, by this process or another) or
        runs on without durability."""
        if not entry.durable or entry.taken_over:
            return False
        patience = min(self.config.claim_after_s / 2, 2 * self.config.timeout_s)
        deadline = time.monotonic() + patience
        while True:
            result = await self._writer.write(entry, items, ttl, frames)
            if result in (1, 2):
                return True
            if result == 0 or entry.lost:
                return False
            if result == -1 or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.2)
        if self.config.required and result == -1:
            self._lose(entry)  # the record is not this turn's as it left it: stop here
        elif self.config.required:
            log.warning("journal: a write of turn %s failed for %g s; it stops here and is "
                        "taken up again from its record", entry.entry_id, patience)  # fmt: skip
            entry.released = True
            self._live.pop(entry.entry_id, None)
            self._released.append(entry)
        else:
            self._give_up(entry)
        return False

    def _set_up(self, up: bool, exc: BaseException | None = None) -> None:
        if up and not self.up and self._said_down:
            log.warning("journal %s is reachable again: new turns are durable", self._where)
        elif not up and (self.up or not self._said_down):
            what = "refused" if self.config.required else "served without durability"
            log.warning("journal %s is unreachable (%s): turns are %s until it is back",
                        self._where, exc, what)  # fmt: skip
            self._said_down = True
        self.up = up

    @property
    def _where(self) -> str:
        kw = self._redis.connection_pool.connection_kwargs
        return f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}"

    def stats(self) -> JournalStats:
        c, w = self._counts, self._writer.counts
        return JournalStats(self.up, c["turns"], c["unjournaled"], w.writes, w.errors,
                            w.flushes, w.seconds, c["recovered"], c["skipped"], c["dropped"],
                            c["taken_over"], c["settled"])  # fmt: skip


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
