"""Reading turns back from the journal (app.server.journal): this process's own after a
restart, those it released after a failed write, and those of processes gone silent; each
checked before anyone runs it.

An entry is taken up only if its record is one of ours and whole (anything else is dropped,
logged once and counted), is that accept's (the header carries the nonce the entry does: a
later accept of the same turn id makes an entry stale), and shows a frame (the start frame
waits for the first: a record without one was never shown to anyone, and nobody may run
it now). Claims skip this process's live turns, and wait `claim_after_s` after it lost
Redis.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import RedisError

from app.server.journal_records import JournalEntry, RecoveredTurn, read_record, record_key

log = logging.getLogger("app.server.journal")

GROUP = "workers"


class Recovery:
    """The journal's side that reads turns back; mixed into Journal, whose state it uses."""

    stream: str
    config: Any  # JournalConfig
    up: bool
    _redis: Any
    _abandon: Any  # scripts
    _heartbeat: Any
    _live: dict[str, JournalEntry]
    _unsure: list[Any]
    _released: list[JournalEntry]
    _claims_from: float
    _counts: dict[str, int]

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
        if time.monotonic() < self._claims_from:
            return []
        found: list[RecoveredTurn] = []
        start = "0-0"
        idle_ms = int(self.config.claim_after_s * 1000)
        unsure = {u.nonce for u in self._unsure}
        while True:
            reply = await self._redis.xautoclaim(
                self.stream, GROUP, self.config.consumer, idle_ms, start, count=100
            )
            start, entries = _text(reply[0]), reply[1]
            for entry_id, fields_ in entries:
                entry_id = _text(entry_id)
                if fields_ is None:
                    continue  # trimmed away meanwhile
                if entry_id in self._live or _text(fields_.get(b"n", b"")) in unsure:
                    continue  # ours and running (this loop stalled), or settled soon
                turn = await self._load(entry_id, fields_)
                if turn is not None:
                    found.append(turn)
            if start == "0-0":
                return found

    async def _load(self, entry_id: str, fields_: dict) -> RecoveredTurn | None:
        key = _text(fields_.get(b"rec", b""))
        nonce = _text(fields_.get(b"n", b""))
        items = await self._redis.lrange(key, 0, -1) if key else []
        if not items:
            return await self._drop(entry_id, f"turn entry {entry_id} has no record")
        try:
            turn = read_record(JournalEntry(entry_id, key, items=len(items), nonce=nonce), items)
        except Exception as exc:  # anything in Redis may be there: nothing here may crash
            return await self._drop(entry_id, f"record {key} unreadable ({exc})")
        if nonce and turn.record.nonce != nonce:
            # An accept that timed out, and the turn was accepted again since: the record
            # is the later accept's.
            return await self._drop(entry_id, f"turn entry {entry_id} is a stale accept")
        if turn.end is None and not turn.texts:
            # No frame recorded, so none was shown (the start frame waits for the first):
            # perhaps its accept's answer never came back. Nobody may run it now.
            log.warning("journal: turn entry %s never began; dropping it", entry_id)
            self._counts["dropped"] += 1
            await self._abandon([self.stream, key],
                                [GROUP, self.config.consumer, entry_id, nonce, 1])  # fmt: skip
            return None
        self._counts["recovered"] += 1
        if turn.end is not None:  # it had finished: only its acknowledgement was lost
            await self._redis.xack(self.stream, GROUP, entry_id)
            await self._redis.expire(key, int(self.config.keep_finished_s))
        else:
            self._live[entry_id] = turn.entry
        return turn

    async def _drop(self, entry_id: str, why: str) -> None:
        log.warning("journal: %s; dropping it", why)
        self._counts["dropped"] += 1
        await self._redis.xack(self.stream, GROUP, entry_id)

    async def discard(self, entry: JournalEntry, why: str) -> None:
        """Drop a turn that cannot be taken up (logged, counted, acknowledged)."""
        self._live.pop(entry.entry_id, None)
        try:
            await self._drop(entry.entry_id, why)
        except RedisError as exc:
            self._set_up(False, exc)

    async def find_finished(self, conversation_key: str, turn_id: str) -> RecoveredTurn | None:
        """A finished turn's record (for a resume after a restart whose `done` was lost)."""
        if not self.up:
            return None
        key = record_key(self.config.namespace, conversation_key, turn_id)
        try:
            items = await self._redis.lrange(key, 0, -1)
            turn = read_record(JournalEntry("", key), items) if items else None
        except RedisError:
            return None
        except Exception:  # not ours, or not whole: as if it were not there
            return None
        return turn if turn is not None and turn.end is not None else None

    async def _take_back_released(self) -> list[RecoveredTurn]:
        """This process's turns released after a failed write, still pending under it:
        taken up again from their records at once (no idle wait)."""
        released, self._released = self._released, []
        try:
            ids = [e.entry_id for e in released]
            mine, _ = await self._heartbeat([self.stream], [GROUP, self.config.consumer, *ids])
            found = []
            for entry_id in (_text(i) for i in mine):
                rows = await self._redis.xrange(self.stream, entry_id, entry_id)
                if rows and (turn := await self._load(entry_id, rows[0][1])) is not None:
                    found.append(turn)
            return found
        except RedisError:
            self._released = released + self._released
            raise


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
