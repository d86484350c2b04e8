"""Running turns: engine outputs -> the turn's stream of frames (and its journal record).

A turn runs as a task of its own, apart from any socket: its frames go to its TurnStream
(app.server.streams), which replays them to whichever socket attaches. With a journal
(app.server.journal), the turn is appended before it is scheduled and each token frame is
recorded before it is shown, so a turn can be taken up again by the next process.

Taking a turn up again (recovery): the turn's recorded output and the text its clients
were sent make an engine Continuation (app.engine.continuation), which chooses between
replaying that output and carrying it in a prefill, cuts it back to the text the clients
had, and keeps the turn's usage its own. A journaled turn that samples is given a seed if
it had none, so that either way its random stream goes on where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import uuid
from dataclasses import dataclass, replace

from app.chat.sessions import conversation_key
from app.engine.continuation import Continuation
from app.engine.engine_request import EngineRequest
from app.engine.outputs import RequestOutput
from app.engine.request import FinishReason
from app.server import protocol as p
from app.server.chat_service import ChatService, Turn
from app.server.errors import ENGINE_ERRORS, ws_error
from app.server.journal import Journal, JournalUnavailable
from app.server.journal_records import JournalEntry, RecoveredTurn, TurnRecord
from app.server.security import Principal
from app.server.streams import Sink, Streams, TurnStream

log = logging.getLogger(__name__)
turns_log = logging.getLogger("parley.chat")  # one line per finished turn

SUPERSEDE_TIMEOUT_S = 10.0  # a cancelled turn ends within an engine step; this is a backstop


@dataclass(frozen=True)
class Resumed:
    """Where a turn taken from the journal picks up: the engine's continuation of its
    recorded output, and what its clients were sent."""

    entry: JournalEntry
    text: str  # the reply text clients were sent
    cont: Continuation


def continuation(tokenizer, turn: RecoveredTurn) -> Resumed | None:
    """Where `turn` picks up; None when its token budget is spent already."""
    text = "".join(turn.texts)
    skip_special = turn.record.params.skip_special_tokens
    cont = Continuation.of(
        turn.record.prompt_ids,
        turn.token_ids,  # exactly those whose text was recorded: a frame's ids go with it
        turn.record.params,
        shown=text,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special),
    )
    if cont is None:
        return None
    return Resumed(turn.entry, text, cont)


class TurnRunner:
    """Starts turns (a client's, or one taken from the journal) and runs each as a task."""

    def __init__(self, chat: ChatService, streams: Streams, journal: Journal | None = None):
        self.chat = chat
        self.streams = streams
        self.journal = journal
        self.closing = False  # shutting down: journaled turns stay pending for the next process
        self._tasks: set[asyncio.Task[None]] = set()
        self._taking_up = asyncio.Lock()  # held while an upkeep round claims and takes up

    # -- what sockets ask -----------------------------------------------------------------

    async def start(self, frame: p.ChatFrame, principal: Principal, sink: Sink) -> TurnStream:
        """Begin a client's turn, streaming to `sink`. Raises ProtocolError."""
        left = self.streams.get(conversation_key(principal.tenant, frame.conversation_id))
        detached = left is not None and not left.finished and left.sink is None
        if detached and left.owner == principal.owner:
            # The client moved on (a reload, a lost page): its new turn supersedes the one
            # it left behind, which is cancelled as if its grace period had ended.
            left.cancel()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SUPERSEDE_TIMEOUT_S):
                    await left.ended()
        turn = self.chat.begin_turn(frame, principal)  # raises: busy, forbidden
        stream = self.streams.open(
            turn.conversation.key, frame.id, frame.conversation_id, principal.owner, sink
        )
        self._spawn(TurnRun(self, turn, stream, None).run())
        return stream

    async def resume(self, frame: p.ResumeFrame, principal: Principal, sink: Sink) -> TurnStream:
        """Attach a turn to `sink` from `frame.after_seq` on. Raises ProtocolError."""
        self.chat.check_access(principal, frame.conversation_id, frame.id)
        key = conversation_key(principal.tenant, frame.conversation_id)
        stream = self.streams.get(key)
        if stream is None and self._taking_up.locked():
            # The round under way may have claimed this very turn (its client was told to
            # resume by the process that stalled): its stream opens when the round ends.
            async with self._taking_up:
                stream = self.streams.get(key)
        if stream is None and self.journal is not None:
            # Nothing here: perhaps it finished just before a restart, its `done` lost.
            done = await self.journal.find_finished(key, frame.id)
            if done is not None and self.streams.get(key) is None:
                self._adopt_finished(done)
        return self.streams.resume(key, frame.id, principal.owner, frame.after_seq, sink)

    def cancel_conversation(self, principal: Principal, conversation_id: str) -> None:
        stream = self.streams.get(conversation_key(principal.tenant, conversation_id))
        if stream is not None and stream.owner == principal.owner:
            stream.cancel()

    # -- turns from the journal -----------------------------------------------------------

    async def keep_journal(self) -> None:
        """One upkeep round (heartbeat, trim, claims), taking up the turns it claimed."""
        assert self.journal is not None
        async with self._taking_up:
            for turn in await self.journal.maintain():
                self.recover(turn)

    def recover(self, turn: RecoveredTurn) -> None:
        """Take up a turn another process (or this one, before a restart) began: its
        stream replays what was sent and continues once a client resumes it. A turn that
        cannot be taken up (its record names tokens this model does not have, ...) is
        dropped from the journal: nothing here raises."""
        try:
            vocab = len(self.chat.prompt.tokenizer)
            if any(t >= vocab for t in (*turn.record.prompt_ids, *turn.token_ids)):
                raise ValueError(f"its token ids are not all below {vocab}")
            self._recover(turn)
        except Exception as exc:
            if self.journal is not None:
                self._spawn(self.journal.discard(turn.entry, f"turn {turn.record.turn_id!r} "
                                                 f"cannot be taken up ({exc})"))  # fmt: skip
            else:
                log.exception("turn %s cannot be taken up", turn.record.turn_id)

    def _recover(self, turn: RecoveredTurn) -> None:
        if turn.end is not None:
            self._adopt_finished(turn)
            return
        rec = turn.record
        principal = Principal(rec.tenant, rec.owner)
        frame = p.ChatFrame(rec.turn_id, rec.conversation_id, list(rec.messages), None, None,
                            rec.params, rec.cache)  # fmt: skip
        chat_turn = self.chat.recovered_turn(frame, principal)
        stream = self.streams.open(
            chat_turn.conversation.key, rec.turn_id, rec.conversation_id, rec.owner, None
        )
        start = turn.start or (len(rec.prompt_ids), 0)
        stream.set_start(p.start_frame(rec.turn_id, rec.conversation_id, *start))
        for text in turn.texts:
            stream.push(text)
        cont = continuation(self.chat.prompt.tokenizer, turn)
        log.info("resuming turn %s of conversation %s from the journal at %d frame(s)",
                 rec.turn_id, rec.conversation_id, len(turn.texts))  # fmt: skip
        if cont is None:
            self._spawn(self._spent(chat_turn, stream, turn))
        else:
            self._spawn(TurnRun(self, chat_turn, stream, cont).run())

    def _adopt_finished(self, turn: RecoveredTurn) -> None:
        rec = turn.record
        key = conversation_key(rec.tenant, rec.conversation_id)
        stream = self.streams.open(key, rec.turn_id, rec.conversation_id, rec.owner, None)
        stream.set_start(p.start_frame(rec.turn_id, rec.conversation_id,
                                       *(turn.start or (len(rec.prompt_ids), 0))))  # fmt: skip
        for text in turn.texts:
            stream.push(text)
        stream.finish(turn.end)

    # -- lifecycle ------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Wait for every turn to end (after the engine stopped, at shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- one turn -------------------------------------------------------------------------

    async def _spent(self, turn: Turn, stream: TurnStream, recovered: RecoveredTurn) -> None:
        """A recovered turn that had produced every token it may: it ends at once."""
        text = "".join(recovered.texts)
        self.chat.end_turn(turn, text, recovered.token_ids)
        usage = p.Usage(len(recovered.record.prompt_ids), len(recovered.token_ids), 0)
        timings = p.Timings(None, None, None, None)
        terminal = p.done_frame(turn.frame.id, "length", usage, timings)
        if self.journal is not None:
            await self.journal.finish(recovered.entry, terminal, True, [])
            if recovered.entry.taken_over:
                terminal = _taken_over(turn.frame.id, recovered.entry.released)
                self.chat.forget(turn)
        stream.finish(terminal)


class TurnRun:
    """One run of a turn, from its engine request to its one terminal frame. What the run
    knows lives here: the reply so far, the ids the journal has not recorded yet, the
    numbers of the start frame (shown with the first recorded token), the last output."""

    def __init__(
        self, runner: TurnRunner, turn: Turn, stream: TurnStream, resumed: Resumed | None
    ) -> None:
        self.runner = runner
        self.chat = runner.chat
        self.journal = runner.journal
        self.turn = turn
        self.frame = turn.frame
        self.stream = stream
        self.request_id = uuid.uuid4().hex
        self.cont = resumed.cont if resumed else None
        self.entry = resumed.entry if resumed else None
        self.reply: list[str] = [resumed.text] if resumed else []
        self.reply_ids: list[int] = list(self.cont.kept_ids) if self.cont else []
        self.unrecorded: list[int] = []  # output ids not in the journal yet
        self.skip = self.cont.skip if self.cont else 0  # output text clients already have
        self.last: RequestOutput | None = None
        self.terminal: str | None = None
        # The start frame's numbers: it is sent with the first token frame, once that is
        # recorded (or with the terminal, for a reply with no text), so that what a client
        # sees of a turn always has a frame in the journal; a record with none was never
        # shown.
        self.start: tuple[int, ...] | None = None

    @property
    def taken_over(self) -> bool:
        """The turn goes on from its journal record, not in this run (JournalEntry)."""
        return self.entry is not None and self.entry.taken_over

    def abort(self) -> None:
        self.chat.engine.abort(self.request_id)

    async def run(self) -> None:
        """Engine outputs -> frames; then exactly one terminal frame, unless the server
        is shutting down and the journal keeps the turn for the next process."""
        self.stream.on_cancel(self.abort)
        frame = self.frame
        try:
            outputs = self.chat.engine.generate(await self._request())
            async for out in outputs:
                if not await self._relay(out):  # taken over: stop, send nothing unrecorded
                    self.abort()
                    await outputs.aclose()
                    self.terminal = _taken_over(frame.id, self.entry.released)
                    break
            else:
                self.terminal = self._done()
        except JournalUnavailable as exc:
            self.terminal = p.error_frame(p.ProtocolError(p.UNAVAILABLE, str(exc), frame.id, True))
        except ENGINE_ERRORS as exc:
            self.terminal = p.error_frame(ws_error(exc, frame.id))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("turn %s of conversation %s failed", frame.id, frame.conversation_id)
            self.terminal = p.error_frame(ws_error(RuntimeError(), frame.id))
        finally:
            last = self.last
            completed = self.terminal is not None and last is not None and last.finished
            ok = completed and last.finish_reason is not FinishReason.ERROR
            reply = "".join(self.reply) if ok else None
            self.chat.end_turn(self.turn, reply, self.reply_ids if ok else None)
        await self._end(ok)

    async def _request(self) -> EngineRequest:
        """The engine request: the prompt (journaled first, when there is a journal), or
        the continuation of a turn taken from the journal."""
        turn, frame = self.turn, self.frame
        salt = self.chat.cache_salt(turn.principal)
        params = frame.params
        if self.cont is None:
            prompt_ids = await self.chat.prompt_ids(turn)
            if self.journal is not None:
                if params.seed is None and not params.greedy:
                    params = replace(params, seed=secrets.randbits(63))
                record = TurnRecord(turn.principal.tenant, turn.principal.owner,
                                    frame.conversation_id, frame.id, turn.messages, params,
                                    frame.cache, salt, prompt_ids)  # fmt: skip
                self.entry = await self.journal.accept(record, turn.conversation.key)
        else:
            prompt_ids = list(self.cont.prompt_ids)
        asked = EngineRequest(
            prompt_ids,
            params,
            self.request_id,
            turn.conversation.key if frame.cache else None,
            use_prefix_cache=frame.cache,  # False: every turn computes its whole prompt
            cache_salt=salt,
            routing_key=turn.conversation.key,  # replicas: where the conversation's K/V is
        )
        # A continuation replays the recorded output, or carries it in its prompt.
        return self.cont.request(asked) if self.cont is not None else asked

    async def _relay(self, out: RequestOutput) -> bool:
        """One engine output to the stream, recorded first; False when the turn was taken
        over and this run must stop."""
        if self.cont is not None:  # usage as the turn's: its prompt, all of its output
            out = self.cont.output(out)
        if self.last is None and self.stream.cancelled:
            self.abort()  # cancelled before the engine had the request: that abort found nothing
        self.last = out
        self.reply_ids += out.new_token_ids
        self.unrecorded += out.new_token_ids
        if self.stream.start is None and self.start is None:
            self.start = (out.prompt_tokens, out.cached_tokens, out.tier_cached_tokens)
        text = self._unseen(out.new_text)
        if not text:
            return True
        if self.entry is not None and self.entry.durable:
            first = self.start if self.stream.start is None else None
            await self.journal.progress(self.entry, self.stream.next_seq, text, self.unrecorded,
                                        first)  # fmt: skip
            self.unrecorded = []
        if self.taken_over:
            return False
        if self.stream.start is None:  # shown once recorded, as every frame
            frame = self.frame
            start = p.start_frame(frame.id, frame.conversation_id, *self.start,
                                  dropped_messages=self.turn.dropped)  # fmt: skip
            self.stream.set_start(start)
        self.reply.append(text)
        self.stream.push(text, out.completion_tokens)
        # One frame may be on its way while the next output comes: waiting for each send
        # would cost every token a round of the loop. A socket slower than that makes the
        # outputs queue and merge at the engine's end (fewer, larger frames).
        await self.stream.sent(unsent=1)
        return True

    def _unseen(self, text: str) -> str:
        """`text` less what a resumed turn's clients were sent already."""
        if self.skip:
            cut = min(self.skip, len(text))
            text, self.skip = text[cut:], self.skip - cut
        return text

    def _done(self) -> str | None:
        """The terminal frame the engine's last output makes (None: it did not finish)."""
        last, frame = self.last, self.frame
        if last is None:
            return None
        if last.finish_reason is FinishReason.ERROR:
            return p.error_frame(
                p.ProtocolError(p.INTERNAL, "the engine failed this turn", frame.id, True)
            )
        if not last.finished:
            return None
        reason = str(last.finish_reason)
        if last.finish_reason is FinishReason.ABORT:
            reason = "cancelled"
        _log_turn(self.turn, last, reason)
        # A continuation's usage is the turn's own (Continuation.output).
        return p.done_frame(frame.id, reason, usage_of(last), timings_of(last))

    async def _end(self, ok: bool) -> None:
        """Record the end, then finish the stream with the terminal frame."""
        last, stream, frame = self.last, self.stream, self.frame
        closing = self.runner.closing
        ended = (
            last is not None
            and last.finished
            and not (closing and last.finish_reason is FinishReason.ABORT)
        )
        if self.entry is not None and self.journal is not None:
            if closing and not ended and self.entry.durable:
                self.journal.release(self.entry)  # the next process takes it up
                stream.finish(None)
                return
            await self.journal.finish(self.entry, self.terminal, ok, self.unrecorded)
            if self.taken_over:
                # Its end not recorded (write-ahead, as its frames): the run that takes it
                # up from the record ends it, and this one's history of it is stale.
                self.terminal = _taken_over(frame.id, self.entry.released)
                self.chat.forget(self.turn)
        if stream.start is None and self.start is not None and not self.taken_over:
            stream.set_start(p.start_frame(frame.id, frame.conversation_id, *self.start))
        stream.finish(self.terminal)


def usage_of(out: RequestOutput) -> p.Usage:
    return p.Usage(
        out.prompt_tokens, out.completion_tokens, out.cached_tokens, out.tier_cached_tokens
    )


def timings_of(out: RequestOutput) -> p.Timings:
    t = out.timings
    ttft = None if t.first_token is None else (t.first_token - t.arrival) * 1000
    queue = None if t.first_scheduled is None else (t.first_scheduled - t.arrival) * 1000
    total = None if t.finished is None else (t.finished - t.arrival) * 1000
    rate = None
    if t.finished is not None and t.first_token is not None and out.completion_tokens > 1:
        span = t.finished - t.first_token
        rate = (out.completion_tokens - 1) / span if span > 0 else None
    return p.Timings(ttft, rate, queue, total)


def _log_turn(turn: Turn, out: RequestOutput, reason: str) -> None:
    t = timings_of(out)
    turns_log.info(
        "turn done: conversation=%s prompt=%d cached=%d completion=%d ttft=%s ms "
        "tok/s=%s finish=%s",
        turn.frame.conversation_id,
        out.prompt_tokens,
        out.cached_tokens,
        out.completion_tokens,
        "-" if t.ttft_ms is None else f"{t.ttft_ms:.0f}",
        "-" if t.tokens_per_s is None else f"{t.tokens_per_s:.1f}",
        reason,
    )


def _taken_over(turn_id: str, released: bool = False) -> str:
    why = (
        "the turn journal failed a write: the turn goes on from its record once it is back"
        if released
        else "this server stalled and another took the turn over"
    )
    return p.error_frame(p.ProtocolError(p.UNAVAILABLE, f"{why}: resume it", turn_id, True))
