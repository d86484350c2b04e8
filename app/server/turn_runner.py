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
        self._spawn(self._run(turn, stream, None))
        return stream

    async def resume(self, frame: p.ResumeFrame, principal: Principal, sink: Sink) -> TurnStream:
        """Attach a turn to `sink` from `frame.after_seq` on. Raises ProtocolError."""
        self.chat.check_access(principal, frame.conversation_id, frame.id)
        key = conversation_key(principal.tenant, frame.conversation_id)
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
            self._spawn(self._run(chat_turn, stream, cont))

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
            if recovered.entry.lost or recovered.entry.released:
                terminal = _taken_over(turn.frame.id, recovered.entry.released)
                self.chat.forget(turn)
        stream.finish(terminal)

    async def _run(self, turn: Turn, stream: TurnStream, resumed: Resumed | None) -> None:
        """Engine outputs -> frames; then exactly one terminal frame, unless the server
        is shutting down and the journal keeps the turn for the next process."""
        frame = turn.frame
        request_id = uuid.uuid4().hex
        stream.on_cancel(lambda: self.chat.engine.abort(request_id))
        cont = resumed.cont if resumed else None
        entry = resumed.entry if resumed else None
        reply: list[str] = [resumed.text] if resumed else []
        reply_ids: list[int] = list(cont.kept_ids) if cont else []
        unrecorded: list[int] = []  # output ids not in the journal yet
        skip = cont.skip if cont else 0
        last: RequestOutput | None = None
        terminal: str | None = None
        # The start frame: sent with the first token frame, once that is recorded (or with
        # the terminal, for a reply with no text), so that what a client sees of a turn
        # always has a frame in the journal; a record with none was never shown.
        start: tuple[int, ...] | None = None
        salt = self.chat.cache_salt(turn.principal)
        try:
            if cont is None:
                prompt_ids = await self.chat.prompt_ids(turn)
                params = frame.params
                if self.journal is not None:
                    if params.seed is None and not params.greedy:
                        params = replace(params, seed=secrets.randbits(63))
                    record = TurnRecord(turn.principal.tenant, turn.principal.owner,
                                        frame.conversation_id, frame.id, turn.messages, params,
                                        frame.cache, salt, prompt_ids)  # fmt: skip
                    entry = await self.journal.accept(record, turn.conversation.key)
            else:
                prompt_ids, params = list(cont.prompt_ids), frame.params
            asked = EngineRequest(
                prompt_ids,
                params,
                request_id,
                turn.conversation.key if frame.cache else None,
                use_prefix_cache=frame.cache,  # False: every turn computes its whole prompt
                cache_salt=salt,
                routing_key=turn.conversation.key,  # replicas: where the conversation's K/V is
            )
            if cont is not None:  # replays the recorded output, or carries it in its prompt
                asked = cont.request(asked)
            outputs = self.chat.engine.generate(asked)
            async for out in outputs:
                if cont is not None:  # usage as the turn's: its prompt, all of its output
                    out = cont.output(out)
                if last is None and stream.cancelled:
                    # Cancelled before the engine had the request: that abort found nothing.
                    self.chat.engine.abort(request_id)
                last = out
                reply_ids += out.new_token_ids
                unrecorded += out.new_token_ids
                if stream.start is None and start is None:
                    start = (out.prompt_tokens, out.cached_tokens, out.tier_cached_tokens)
                text = out.new_text
                if skip:
                    cut = min(skip, len(text))
                    text, skip = text[cut:], skip - cut
                if not text:
                    continue
                if entry is not None and entry.durable:
                    first = start if stream.start is None else None
                    await self.journal.progress(entry, stream.next_seq, text, unrecorded, first)
                    unrecorded = []
                if entry is not None and (entry.lost or entry.released):
                    # Another process took the turn over while this one stalled, or the
                    # journal failed a write for too long: the turn goes on from its record
                    # (elsewhere, or here once Redis answers). This run stops, and sends
                    # nothing unrecorded.
                    self.chat.engine.abort(request_id)
                    await outputs.aclose()
                    terminal = _taken_over(frame.id, entry.released)
                    break
                if stream.start is None:  # shown once recorded, as every frame
                    stream.set_start(p.start_frame(frame.id, frame.conversation_id, *start,
                                                   dropped_messages=turn.dropped))  # fmt: skip
                reply.append(text)
                stream.push(text, out.completion_tokens)
                await stream.sent()
            else:
                terminal = self._terminal(turn, last)
        except JournalUnavailable as exc:
            terminal = p.error_frame(p.ProtocolError(p.UNAVAILABLE, str(exc), frame.id, True))
        except ENGINE_ERRORS as exc:
            terminal = p.error_frame(ws_error(exc, frame.id))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("turn %s of conversation %s failed", frame.id, frame.conversation_id)
            terminal = p.error_frame(ws_error(RuntimeError(), frame.id))
        finally:
            completed = terminal is not None and last is not None and last.finished
            ok = completed and last.finish_reason is not FinishReason.ERROR
            self.chat.end_turn(turn, "".join(reply) if ok else None, reply_ids if ok else None)
        ended = (
            last is not None
            and last.finished
            and not (self.closing and last.finish_reason is FinishReason.ABORT)
        )
        if entry is not None and self.journal is not None:
            if self.closing and not ended and entry.durable:
                self.journal.release(entry)  # the next process takes it up
                stream.finish(None)
                return
            await self.journal.finish(entry, terminal, ok, unrecorded)
            if entry.lost or entry.released:
                # Its end not recorded (write-ahead, as its frames): the run that takes it
                # up from the record ends it, and this one's history of it is stale.
                terminal = _taken_over(frame.id, entry.released)
                self.chat.forget(turn)
        if (
            stream.start is None
            and start is not None
            and not (entry and (entry.lost or entry.released))
        ):
            stream.set_start(p.start_frame(frame.id, frame.conversation_id, *start))
        stream.finish(terminal)

    def _terminal(self, turn: Turn, last: RequestOutput | None) -> str | None:
        frame = turn.frame
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
        self.chat.log_turn(turn, last, reason)
        usage = self.chat.usage(last)  # a continuation's: the turn's own (Continuation.output)
        return p.done_frame(frame.id, reason, usage, self.chat.timings(last))


def _taken_over(turn_id: str, released: bool = False) -> str:
    why = (
        "the turn journal failed a write: the turn goes on from its record once it is back"
        if released
        else "this server stalled and another took the turn over"
    )
    return p.error_frame(p.ProtocolError(p.UNAVAILABLE, f"{why}: resume it", turn_id, True))
