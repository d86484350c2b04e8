"""Turns that outlive their socket: a replay buffer per turn, re-attached by seq.

A turn's frames go into its TurnStream, not straight to a socket. The socket that started
the turn, or one that resumed it later, is the stream's sink: a pump task sends it every
frame after a given seq, then follows the live ones. When the socket goes, the turn is
*detached*, not cancelled: it runs on for a grace period with its frames kept, and a
`resume` frame {id, conversation_id, after_seq} on another socket of the same owner
attaches it again: every token frame after `after_seq` is replayed, then the rest follows
live, then its one terminal frame. A turn nobody comes back for is cancelled when its grace
period ends (the engine's abort frees its blocks). A finished turn is kept as long, since
its `done` may have been lost with the socket, and is then forgotten: a resume of it gets
`expired`, and one of a turn never seen `unknown_id`.

A turn is named by its conversation's key (tenant namespace + conversation id) and the
client's turn id: a conversation has at most one turn in flight, so two clients' ids never
collide. The stream records the owner; only the owner may resume it.

Backpressure is as before: the runner waits until the attached sink has taken a frame
before it reads the engine's next output (which merges whatever a slow reader missed);
a detached turn is never held up.

The engine never knows: a stream sees only text frames. Frames are kept as the JSON text
sent, not as objects: a frame is serialised once, however many sockets it is replayed to
(a resume, a reload), and the terminal frame is the very string the journal records; token
frames are kept as their texts and made at send time, their seq being their place.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from app.server import protocol as p

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamsConfig:
    grace_s: float = 60.0  # a dropped turn waits this long for its client; 0: cancel at once
    max_kept: int = 1024  # detached and finished turns kept for resume; the oldest go first
    max_frames: int = 16384  # token frames a turn keeps for replay
    max_forgotten: int = 4096  # forgotten turns remembered to answer `expired`

    def __post_init__(self) -> None:
        if self.grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        if self.max_kept < 0 or self.max_frames < 1:
            raise ValueError("max_kept must be >= 0 and max_frames >= 1")


@dataclass(frozen=True)
class StreamStats:
    """Counters for /metrics."""

    attached: int  # turns streaming to a socket now
    detached: int  # running turns waiting for their client
    finished: int  # finished turns kept for a late resume
    resumes: int  # successful resumes
    expired: int  # turns cancelled because nobody came back in time


class Sink(Protocol):
    """Where a stream's frames go: a socket."""

    async def send(self, text: str) -> bool:
        """Send one frame; False when the socket is gone."""
        ...

    def release(self, stream: TurnStream) -> None:
        """The stream no longer streams here (its terminal frame was sent, or another
        socket took it over)."""
        ...


class TurnStream:
    """One turn's frames: its start, its token texts by seq (the last `max_frames`), its
    terminal; and the sink they go to, if any."""

    def __init__(
        self, streams: Streams, key: str, turn_id: str, conversation_id: str, owner: str
    ) -> None:
        self._streams = streams
        self.key = key
        self.id = turn_id
        self.conversation_id = conversation_id
        self.owner = owner
        self.start: str | None = None
        self._texts: list[str] = []  # token texts from seq `first_seq` on
        self._counts: list[int | None] = []  # the reply's tokens at each of them, if known
        self.first_seq = 0
        self.next_seq = 0
        self.finished = False
        self.terminal: str | None = None  # None when finished: ended without one (shutdown)
        self.cancelled = False
        self.expired = False
        self._on_cancel: Callable[[], None] | None = None
        self._sink: Sink | None = None
        self._cursor = 0  # the next seq the sink gets
        self._pump: asyncio.Task[None] | None = None
        self._pump_gen = 0
        self._waiters: list[asyncio.Future[None]] = []
        self.timer: asyncio.TimerHandle | None = None

    @property
    def sink(self) -> Sink | None:
        return self._sink

    # -- the runner's side ----------------------------------------------------------------

    def on_cancel(self, abort: Callable[[], None]) -> None:
        """How to cancel the turn (abort its engine request); applied at once if a cancel
        came first."""
        self._on_cancel = abort
        if self.cancelled:
            abort()

    def cancel(self) -> None:
        """Stop the turn: it ends with finish_reason "cancelled"."""
        self.cancelled = True
        if self._on_cancel is not None and not self.finished:
            self._on_cancel()

    def set_start(self, frame: str) -> None:
        self.start = frame
        self._wake()

    def push(self, text: str, completion_tokens: int | None = None) -> int:
        """Add a token frame (with the reply's tokens so far, where known); returns its seq."""
        seq = self.next_seq
        self._texts.append(text)
        self._counts.append(completion_tokens)
        self.next_seq += 1
        overflow = len(self._texts) - self._streams.config.max_frames
        if overflow > 0:
            del self._texts[:overflow]
            del self._counts[:overflow]
            self.first_seq += overflow
        self._wake()
        return seq

    async def sent(self, unsent: int = 0) -> None:
        """Wait until the attached sink is at most `unsent` frames behind (at once when
        detached)."""
        while self._sink is not None and self._cursor + unsent < self.next_seq:
            await self._wait()

    async def ended(self) -> None:
        """Wait until the turn is over."""
        while not self.finished:
            await self._wait()

    def finish(self, terminal: str | None) -> None:
        """The turn is over; `terminal` is its done or error frame (None: it ends without
        one, e.g. a journaled turn at shutdown, which the next process resumes)."""
        if self.finished:
            return
        self.finished = True
        self.terminal = terminal
        self._wake()
        self._streams._finished(self)

    # -- the sockets' side ----------------------------------------------------------------

    def attach(self, sink: Sink, after_seq: int) -> None:
        """Stream to `sink` every token frame after `after_seq`, then live. The start
        frame is (re)sent first; a sink this replaces is released."""
        old = self._sink
        self._sink = sink
        self._cursor = after_seq + 1
        self._pump_gen += 1  # a pump of an earlier attach stops after its current send
        if old is not None and old is not sink:
            old.release(self)
        self._pump = asyncio.create_task(self._run_pump(sink, self._pump_gen))
        self._wake()
        self._streams._attached(self)

    def detach(self, sink: Sink) -> None:
        """`sink` is gone: the turn runs on without it for the grace period."""
        if self._sink is not sink:
            return
        self._sink = None
        self._wake()
        self._streams._detached(self)

    async def _run_pump(self, sink: Sink, gen: int) -> None:
        start_sent = False
        try:
            while self._pump_gen == gen:
                if not start_sent and self.start is not None:
                    if not await sink.send(self.start):
                        return
                    start_sent = True
                elif self._cursor < self.next_seq:
                    seq = self._cursor
                    if seq < self.first_seq:  # fell out of the replay window (a huge reply)
                        gone = p.ProtocolError(
                            p.EXPIRED, f"frames after seq {seq - 1} are no longer kept", self.id
                        )
                        await sink.send(p.error_frame(gone))
                        self._release(sink, gen)
                        return
                    text = self._texts[seq - self.first_seq]
                    count = self._counts[seq - self.first_seq]
                    if not await sink.send(p.token_frame(self.id, seq, text, count)):
                        return
                    if self._pump_gen == gen:
                        self._cursor = seq + 1
                        self._wake()
                elif self.finished:
                    # Released first: once the client has the terminal it may reuse the id.
                    self._release(sink, gen)
                    if self.terminal is not None:
                        await sink.send(self.terminal)
                    return
                else:
                    await self._wait()
        finally:
            if self._pump_gen == gen:
                self.detach(sink)  # the socket is gone (a no-op once released)

    def _release(self, sink: Sink, gen: int) -> None:
        if self._pump_gen == gen and self._sink is sink:
            self._sink = None
            self._wake()
            self._streams._released(self)
        sink.release(self)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    def close(self) -> None:
        """Stop the pump (shutdown)."""
        self._pump_gen += 1
        if self._pump is not None:
            self._pump.cancel()
        self._sink = None
        self._wake()


class Streams:
    """Every turn's stream, by conversation key, and the timers of those without a socket."""

    def __init__(self, config: StreamsConfig | None = None) -> None:
        self.config = config or StreamsConfig()
        self._by_key: dict[str, TurnStream] = {}
        self._kept: OrderedDict[str, TurnStream] = OrderedDict()  # no sink: oldest first
        self._forgotten: OrderedDict[tuple[str, str], str] = OrderedDict()  # -> owner
        self._resumes = 0
        self._expired = 0

    def open(
        self, key: str, turn_id: str, conversation_id: str, owner: str, sink: Sink | None
    ) -> TurnStream:
        """A new turn of conversation `key` (its previous turn, finished, is forgotten).
        Without a sink (a turn recovered from the journal) it starts detached."""
        old = self._by_key.get(key)
        if old is not None:
            self._forget(old)
        stream = TurnStream(self, key, turn_id, conversation_id, owner)
        self._by_key[key] = stream
        if sink is not None:
            stream.attach(sink, -1)
        else:
            self._detached(stream)
        return stream

    def get(self, key: str) -> TurnStream | None:
        return self._by_key.get(key)

    def resume(self, key: str, turn_id: str, owner: str, after_seq: int, sink: Sink) -> TurnStream:
        """Attach turn `turn_id` of conversation `key` to `sink` from `after_seq` on.
        Raises ProtocolError: forbidden, expired, unknown_id, bad_request."""
        stream = self._by_key.get(key)
        if stream is not None and stream.owner != owner:
            raise p.ProtocolError(
                p.FORBIDDEN, "that turn belongs to another client's conversation", turn_id
            )
        if stream is None or stream.id != turn_id:
            gone = self._forgotten.get((key, turn_id))
            if gone is not None and gone != owner:
                raise p.ProtocolError(
                    p.FORBIDDEN, "that turn belongs to another client's conversation", turn_id
                )
            if gone is not None:
                raise p.ProtocolError(
                    p.EXPIRED,
                    f"turn {turn_id!r} is over and no longer kept: send the turn again",
                    turn_id,
                )
            raise p.ProtocolError(p.UNKNOWN_ID, f"no turn {turn_id!r} to resume here", turn_id)
        if stream.expired:
            raise p.ProtocolError(
                p.EXPIRED,
                f"turn {turn_id!r} was cancelled: nobody resumed it within "
                f"{self.config.grace_s:g} s",
                turn_id,
            )
        if after_seq + 1 < stream.first_seq:
            raise p.ProtocolError(
                p.EXPIRED, f"frames after seq {after_seq} are no longer kept", turn_id
            )
        if after_seq >= stream.next_seq:
            raise p.ProtocolError(
                p.EXPIRED,
                f"the server has frames up to seq {stream.next_seq - 1} only: it lost the "
                f"rest (a restart without a journal write); send the turn again",
                turn_id,
            )
        self._resumes += 1
        stream.attach(sink, after_seq)
        return stream

    def stats(self) -> StreamStats:
        attached = sum(1 for s in self._by_key.values() if s.sink is not None)
        finished = sum(1 for s in self._kept.values() if s.finished)
        return StreamStats(attached, len(self._kept) - finished, finished, self._resumes,
                           self._expired)  # fmt: skip

    def close(self) -> None:
        """Shutdown: stop every pump and timer; forget everything."""
        for stream in list(self._by_key.values()):
            if stream.timer is not None:
                stream.timer.cancel()
            stream.close()
        self._by_key.clear()
        self._kept.clear()

    # -- what the streams tell us ---------------------------------------------------------

    def _attached(self, stream: TurnStream) -> None:
        self._kept.pop(stream.key, None)
        if stream.timer is not None and not stream.finished:
            stream.timer.cancel()
            stream.timer = None

    def _detached(self, stream: TurnStream) -> None:
        if stream.finished:
            self._keep(stream)
        elif self.config.grace_s == 0:
            self._expire(stream)
        else:
            self._keep(stream)
            self._set_timer(stream, self.config.grace_s, self._expire)

    def _released(self, stream: TurnStream) -> None:
        self._keep(stream)

    def _finished(self, stream: TurnStream) -> None:
        if self._by_key.get(stream.key) is not stream:
            return
        if stream.expired or stream.terminal is None:
            self._forget(stream)
            return
        self._set_timer(stream, self.config.grace_s, self._forget)
        if stream.sink is None:
            self._keep(stream)

    def _keep(self, stream: TurnStream) -> None:
        if self._by_key.get(stream.key) is not stream:
            return
        self._kept[stream.key] = stream
        self._kept.move_to_end(stream.key)
        while len(self._kept) > self.config.max_kept:
            _, oldest = self._kept.popitem(last=False)
            if oldest.finished:
                self._forget(oldest)
            else:
                self._expire(oldest)

    def _set_timer(
        self, stream: TurnStream, delay: float, then: Callable[[TurnStream], None]
    ) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
        if delay <= 0:
            stream.timer = None
            then(stream)
            return
        stream.timer = asyncio.get_running_loop().call_later(delay, then, stream)

    def _expire(self, stream: TurnStream) -> None:
        """Nobody came back for a running turn: cancel it (then forget it once over)."""
        if stream.finished or stream.sink is not None:
            if stream.finished:
                self._forget(stream)
            return
        log.info("turn %s: nobody resumed it within %g s; cancelling", stream.id,
                 self.config.grace_s)  # fmt: skip
        self._expired += 1
        stream.expired = True
        stream.cancel()

    def _forget(self, stream: TurnStream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if self._by_key.get(stream.key) is stream:
            del self._by_key[stream.key]
            self._kept.pop(stream.key, None)
        self._forgotten[(stream.key, stream.id)] = stream.owner
        self._forgotten.move_to_end((stream.key, stream.id))
        while len(self._forgotten) > self.config.max_forgotten:
            self._forgotten.popitem(last=False)
