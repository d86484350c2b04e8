"""The durable turn log on Redis Streams: accepted turns survive a restart of the server.

Layout (namespace `parley` by default):

    parley:turns        a stream; one entry per accepted turn, field `rec` names its record
    group "workers"     the consumer group: an entry is pending under the process running it
    parley:rec:<hash>   the turn's record, a list: header, one item per frame, end
                        (app.server.journal_records)

A turn is appended (XADD, then XREADGROUP in the same MULTI, so the entry is pending under
this process from the start) before it is scheduled. Each token frame is recorded before it
is sent (write-ahead), so whatever a client saw is in the journal and a restart can never
show it a gap or a duplicate: frames of all turns are written together, one pipeline per
Redis round trip (group commit), so the cost is a round trip of latency per frame, not one
per turn. At the end the record gets its end, the entry is acknowledged (XACK) and the
record expires after `keep_finished_s` (a resume whose `done` was lost still finds it).

Recovery: at start-up a process takes back the entries still pending under its own name
(a restart of the same server), and every `claim_after_s / 3` it takes over (XAUTOCLAIM)
entries left idle longer than `claim_after_s` by a process that stopped: a live process
refreshes its own entries' idle time (XCLAIM to itself) as a heartbeat. The stream is
trimmed of acknowledged entries once it holds more than `max_turns`.

Faults: when Redis cannot be reached, turns are served without durability (one log line,
`parley:journal_up` 0), or refused with `unavailable` under `required`; a turn whose
record missed a write is not resumed later (its entry is acknowledged when Redis is back).

The engine never knows: this is the server's log of its /ws turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from app.server.journal_records import (
    VERSION,
    JournalEntry,
    RecoveredTurn,
    TurnRecord,
    read_record,
    record_key,
)

log = logging.getLogger(__name__)

GROUP = "workers"


# Refresh the idle time of this process's entries that are still its own (another process
# may have claimed one while this one stalled: that one is lost, not taken back).
_HEARTBEAT = """
local kept = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    kept[#kept + 1] = ARGV[i]
  end
end
return kept
"""

# Past the bound, drop acknowledged entries: all older than the oldest pending one.
_TRIM = """
if redis.call('XLEN', KEYS[1]) <= tonumber(ARGV[2]) then return 0 end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1])
if pending[1] > 0 then return redis.call('XTRIM', KEYS[1], 'MINID', pending[2]) end
return redis.call('XTRIM', KEYS[1], 'MAXLEN', 0)
"""


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


@dataclass
class _Write:
    entry: JournalEntry
    commands: list[tuple[Any, ...]]
    frames: int  # token frames it records
    done: asyncio.Future[bool] = field(repr=False)


class Journal:
    """One process's side of the journal."""

    def __init__(self, config: JournalConfig) -> None:
        self.config = config
        self.stream = f"{config.namespace}:turns"
        self._redis = aioredis.Redis.from_url(
            config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s
        )
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._trim = self._redis.register_script(_TRIM)
        self.up = False
        self._said_down = False
        self._live: dict[str, JournalEntry] = {}  # entry id -> in flight here
        self._abandoned: list[JournalEntry] = []  # to acknowledge once Redis is back
        self._queue: list[_Write] = []
        self._flusher: asyncio.Task[None] | None = None
        self._counts = dict(turns=0, unjournaled=0, writes=0, write_errors=0, flushes=0,
                            recovered=0)  # fmt: skip
        self._flush_seconds = 0.0

    # -- start-up and maintenance ------------------------------------------------------------

    async def open(self) -> list[RecoveredTurn]:
        """Connect, and take back the turns pending under this process's name (its own,
        from before a restart). Redis down: [] (turns run without durability)."""
        try:
            await self._ensure_group()
            self._set_up(True)
            return await self._take_back()
        except RedisError as exc:
            self._set_up(False, exc)
            return []

    async def maintain(self) -> list[RecoveredTurn]:
        """One round of housekeeping: reconnect, heartbeat, trim, and take over turns of
        silent processes (returned, to be resumed)."""
        try:
            if not self.up:
                await self._ensure_group()
                self._set_up(True)
            await self._settle_abandoned()
            if self._live:
                ids = list(self._live)
                mine = await self._heartbeat([self.stream], [GROUP, self.config.consumer, *ids])
                kept = {_text(i) for i in mine}
                for lost in set(ids) - kept:
                    entry = self._live.pop(lost, None)  # None: it finished meanwhile
                    if entry is not None:
                        log.warning("journal: turn %s was taken over by another process", lost)
                        entry.durable = False
            await self._trim([self.stream], [GROUP, self.config.max_turns])
            return await self._claim_stale()
        except RedisError as exc:
            self._set_up(False, exc)
            return []

    async def close(self) -> None:
        if self._flusher is not None:
            with contextlib.suppress(Exception):
                await self._flusher
        await self._redis.aclose()

    async def _ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _take_back(self) -> list[RecoveredTurn]:
        found: list[RecoveredTurn] = []
        after = "0"
        while True:
            reply = await self._redis.xreadgroup(
                GROUP, self.config.consumer, {self.stream: after}, count=100
            )
            entries = reply[0][1] if reply else []
            if not entries:
                return found + await self._claim_stale()
            for entry_id, fields_ in entries:
                after = _text(entry_id)
                turn = await self._load(after, fields_)
                if turn is not None:
                    found.append(turn)

    async def _claim_stale(self) -> list[RecoveredTurn]:
        found: list[RecoveredTurn] = []
        start = "0-0"
        idle_ms = int(self.config.claim_after_s * 1000)
        while True:
            reply = await self._redis.xautoclaim(
                self.stream, GROUP, self.config.consumer, idle_ms, start, count=100
            )
            start, entries = _text(reply[0]), reply[1]
            for entry_id, fields_ in entries:
                if fields_ is None:
                    continue  # trimmed away meanwhile
                turn = await self._load(_text(entry_id), fields_)
                if turn is not None:
                    found.append(turn)
            if start == "0-0":
                return found

    async def _load(self, entry_id: str, fields_: dict) -> RecoveredTurn | None:
        key = _text(fields_.get(b"rec", b""))
        items = await self._redis.lrange(key, 0, -1) if key else []
        if not items:
            log.warning("journal: turn entry %s has no record; dropping it", entry_id)
            await self._redis.xack(self.stream, GROUP, entry_id)
            return None
        try:
            turn = read_record(JournalEntry(entry_id, key), items)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("journal: record %s unreadable (%s); dropping it", key, exc)
            await self._redis.xack(self.stream, GROUP, entry_id)
            return None
        self._counts["recovered"] += 1
        if turn.end is not None:  # it had finished: only its acknowledgement was lost
            await self._redis.xack(self.stream, GROUP, entry_id)
            await self._redis.expire(key, int(self.config.keep_finished_s))
        else:
            self._live[entry_id] = turn.entry
        return turn

    async def find_finished(self, conversation_key: str, turn_id: str) -> RecoveredTurn | None:
        """A finished turn's record (for a resume after a restart whose `done` was lost)."""
        if not self.up:
            return None
        key = record_key(self.config.namespace, conversation_key, turn_id)
        try:
            items = await self._redis.lrange(key, 0, -1)
            turn = read_record(JournalEntry("", key), items) if items else None
        except (RedisError, ValueError, KeyError, TypeError):
            return None
        return turn if turn is not None and turn.end is not None else None

    async def _settle_abandoned(self) -> None:
        while self._abandoned:
            entry = self._abandoned[-1]
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xack(self.stream, GROUP, entry.entry_id)
                pipe.delete(entry.record_key)
                await pipe.execute()
            self._abandoned.pop()

    # -- a turn's writes ---------------------------------------------------------------------

    async def accept(self, record: TurnRecord, conversation_key: str) -> JournalEntry | None:
        """Append a turn before it is scheduled. None: Redis is unreachable and the turn
        runs without durability. Raises JournalUnavailable instead when required."""
        if self.up:
            key = record_key(self.config.namespace, conversation_key, record.turn_id)
            try:
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.delete(key)
                    pipe.rpush(key, record.to_json())
                    pipe.xadd(self.stream, {"rec": key, "v": VERSION})
                    pipe.xreadgroup(GROUP, self.config.consumer, {self.stream: ">"}, count=1)
                    *_, added, read = await pipe.execute()
                taken = _text(read[0][1][0][0]) if read else None
                if taken != _text(added):  # another writer broke the XADD+XREADGROUP pairing
                    raise ResponseError(f"journal entry {added} was not delivered to us")
                entry = JournalEntry(_text(added), key)
                self._live[entry.entry_id] = entry
                self._counts["turns"] += 1
                return entry
            except RedisError as exc:
                self._set_up(False, exc)
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
        is sent. False: not recorded (the turn is no longer durable)."""
        item: dict[str, Any] = {"s": seq, "t": text, "i": token_ids}
        if start is not None:
            item["start"] = list(start)
        return await self._write(entry, [("RPUSH", entry.record_key, _dump(item))], frames=1)

    async def finish(
        self, entry: JournalEntry, terminal: str | None, ok: bool, token_ids: list[int]
    ) -> None:
        """The turn is over: record its end, acknowledge it, let the record expire."""
        self._live.pop(entry.entry_id, None)
        if not entry.durable:
            self._abandoned.append(entry)
            return
        end = _dump({"end": terminal, "ok": ok, "i": token_ids})
        commands = [
            ("RPUSH", entry.record_key, end),
            ("XACK", self.stream, GROUP, entry.entry_id),
            ("EXPIRE", entry.record_key, int(self.config.keep_finished_s)),
        ]
        if not await self._write(entry, commands):
            self._abandoned.append(entry)

    def release(self, entry: JournalEntry) -> None:
        """Leave a turn pending (shutdown): the next process resumes it."""
        self._live.pop(entry.entry_id, None)

    async def _write(
        self, entry: JournalEntry, commands: list[tuple[Any, ...]], frames: int = 0
    ) -> bool:
        if not entry.durable:
            return False
        if not self.up:
            entry.durable = False
            return False
        write = _Write(entry, commands, frames, asyncio.get_running_loop().create_future())
        self._queue.append(write)
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        return await write.done

    async def _flush(self) -> None:
        """Group commit: whatever queued while the last round trip was out goes in the
        next one."""
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                began = time.perf_counter()
                ok = True
                try:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for write in batch:
                            for command in write.commands:
                                pipe.execute_command(*command)
                        await pipe.execute()
                except RedisError as exc:
                    ok = False
                    self._counts["write_errors"] += 1
                    self._set_up(False, exc)
                self._flush_seconds += time.perf_counter() - began
                self._counts["flushes"] += 1
                self._counts["writes"] += sum(w.frames for w in batch) if ok else 0
                for write in batch:
                    if not ok:
                        write.entry.durable = False
                    if not write.done.done():
                        write.done.set_result(ok)
        finally:
            self._flusher = None

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
        c = self._counts
        return JournalStats(self.up, c["turns"], c["unjournaled"], c["writes"],
                            c["write_errors"], c["flushes"], self._flush_seconds,
                            c["recovered"])  # fmt: skip


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
