"""/ws: one receive loop per connection; each turn streams from its own task.

Several conversations share a connection, and several turns run at once across them (one
per conversation). Frames of different turns interleave; each turn's frames stay in order
and end with exactly one `done` or `error`. A closed socket cancels its turns: their
requests are aborted within one engine step (their K/V stays pinned to the conversation).

Backpressure: sends are awaited, so a client that reads slowly holds up its own turns, and
meanwhile the engine's outputs for them merge into bigger deltas (AsyncEngine.generate)
instead of piling up as a backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from app.engine.async_engine import EngineDeadError, EngineOverloadedError
from app.engine.request import FinishReason
from app.server import protocol as p
from app.server.turns import ChatService, Turn

log = logging.getLogger(__name__)


@dataclass
class ActiveTurn:
    turn: Turn
    request_id: str  # the engine's id: unique across connections, unlike the client's
    task: asyncio.Task[None] | None = None


class ChatSocket:
    """One WebSocket connection and its turns in flight."""

    def __init__(self, websocket: WebSocket, chat: ChatService) -> None:
        self.ws = websocket
        self.chat = chat
        self.turns: dict[str, ActiveTurn] = {}  # by the client's turn id
        self._send_lock = asyncio.Lock()
        self._closed = False

    async def run(self) -> None:
        await self.ws.accept()
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                raw = message.get("text")
                if raw is None:
                    raw = message.get("bytes") or b""
                try:
                    frame = p.parse_frame(raw, self.chat.max_tokens_limit)
                    await self._handle(frame)
                except p.ProtocolError as err:
                    await self.send(p.error_frame(err))
        except WebSocketDisconnect:
            pass
        finally:
            self._closed = True
            await self._cancel_all()

    async def send(self, text: str) -> bool:
        """Send one frame; False if the socket is gone."""
        if self._closed:
            return False
        async with self._send_lock:
            try:
                await self.ws.send_text(text)
                return True
            except (WebSocketDisconnect, RuntimeError, OSError):
                self._closed = True
                return False

    async def _handle(self, frame: p.Frame) -> None:
        if isinstance(frame, p.PingFrame):
            await self.send(p.pong_frame())
        elif isinstance(frame, p.CancelFrame):
            active = self.turns.get(frame.id)
            if active is None:
                raise p.ProtocolError(p.UNKNOWN_ID, f"no turn {frame.id!r} is in flight", frame.id)
            self.chat.engine.abort(active.request_id)  # ends with finish_reason "cancelled"
        elif isinstance(frame, p.DeleteFrame):
            for active in self.turns.values():
                if active.turn.frame.conversation_id == frame.conversation_id:
                    self.chat.engine.abort(active.request_id)  # before the release: FIFO
            self.chat.delete(frame.conversation_id)
            await self.send(p.deleted_frame(frame.conversation_id))
        elif isinstance(frame, p.ChatFrame):
            self._start_turn(frame)

    def _start_turn(self, frame: p.ChatFrame) -> None:
        if frame.id in self.turns:
            raise p.ProtocolError(
                p.DUPLICATE_ID, f"turn {frame.id!r} is already in flight", frame.id
            )
        if len(self.turns) >= self.chat.config.max_turns_per_socket:
            raise p.ProtocolError(
                p.TOO_MANY_TURNS,
                f"at most {self.chat.config.max_turns_per_socket} turns in flight per connection",
                frame.id,
                retryable=True,
            )
        turn = self.chat.begin_turn(frame)  # raises ProtocolError (busy, too long, ...)
        active = ActiveTurn(turn, uuid.uuid4().hex)
        self.turns[frame.id] = active
        active.task = asyncio.create_task(self._stream(active))

    async def _stream(self, active: ActiveTurn) -> None:
        turn, frame = active.turn, active.turn.frame
        started = False
        seq = 0
        reply: list[str] = []
        reply_ids: list[int] = []
        last = None
        try:
            if frame.cache:
                stream = self.chat.engine.generate(
                    turn.prompt_ids, frame.params, active.request_id, frame.conversation_id
                )
            else:  # no K/V kept or reused: every turn computes its whole prompt
                stream = self.chat.engine.generate(
                    turn.prompt_ids, frame.params, active.request_id, use_prefix_cache=False
                )
            async for out in stream:
                last = out
                reply_ids += out.new_token_ids
                if not started:
                    started = await self.send(
                        p.start_frame(
                            frame.id, frame.conversation_id, out.prompt_tokens, out.cached_tokens
                        )
                    )
                if out.new_text:
                    reply.append(out.new_text)
                    if not await self.send(p.token_frame(frame.id, seq, out.new_text)):
                        break  # the client is gone: leaving the loop aborts the request
                    seq += 1
            if last is not None and last.finish_reason is FinishReason.ERROR:
                self.chat.end_turn(turn, None, None)
                err = p.ProtocolError(p.INTERNAL, "the engine failed this turn", frame.id, True)
                await self.send(p.error_frame(err))
            elif last is not None and last.finished:
                if not started:
                    await self.send(
                        p.start_frame(
                            frame.id, frame.conversation_id, last.prompt_tokens, last.cached_tokens
                        )
                    )
                self.chat.end_turn(turn, "".join(reply), reply_ids)
                reason = str(last.finish_reason)
                if last.finish_reason is FinishReason.ABORT:
                    reason = "cancelled"
                self.chat.log_turn(turn, last, reason)
                await self.send(
                    p.done_frame(frame.id, reason, self.chat.usage(last), self.chat.timings(last))
                )
            else:
                self.chat.end_turn(turn, None, None)
        except ValueError as exc:  # the engine refused the prompt (too long, ...)
            self.chat.end_turn(turn, None, None)
            code = p.TOO_LONG if "context" in str(exc) or "KV cache" in str(exc) else p.BAD_REQUEST
            await self.send(p.error_frame(p.ProtocolError(code, str(exc), frame.id)))
        except EngineOverloadedError as exc:
            self.chat.end_turn(turn, None, None)
            await self.send(p.error_frame(p.ProtocolError(p.BUSY, str(exc), frame.id, True)))
        except EngineDeadError as exc:
            self.chat.end_turn(turn, None, None)
            err = p.ProtocolError(p.INTERNAL, str(exc), frame.id, retryable=True)
            await self.send(p.error_frame(err))
        except asyncio.CancelledError:
            self.chat.end_turn(turn, None, None)
            raise
        except Exception:
            log.exception("turn %s of conversation %s failed", frame.id, frame.conversation_id)
            self.chat.end_turn(turn, None, None)
            err = p.ProtocolError(p.INTERNAL, "internal error", frame.id, retryable=True)
            await self.send(p.error_frame(err))
        finally:
            self.turns.pop(frame.id, None)

    async def _cancel_all(self) -> None:
        tasks = [a.task for a in self.turns.values() if a.task is not None]
        if tasks:
            log.info("connection closed: cancelling %d turn(s) in flight", len(tasks))
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.ws.client_state is WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await self.ws.close()


# Close codes (RFC 6455): policy violation, and "try again later".
POLICY_VIOLATION = 1008
TRY_AGAIN_LATER = 1013


async def ws_endpoint(websocket: WebSocket) -> None:
    access, chat = websocket.state.access, websocket.state.chat
    if not access.origin_ok(websocket.headers, websocket.url.scheme):
        log.warning("refused a /ws handshake from origin %s", websocket.headers.get("origin"))
        await websocket.close(POLICY_VIOLATION)  # before accept: the handshake gets a 403
        return
    if not (access.cookie_ok(websocket.cookies) or access.bearer_ok(websocket.headers)):
        await websocket.close(POLICY_VIOLATION)
        return
    if chat.connections >= chat.config.max_connections:
        await websocket.accept()
        err = p.ProtocolError(
            p.BUSY,
            f"too many connections (at most {chat.config.max_connections}); retry shortly",
            retryable=True,
        )
        await websocket.send_text(p.error_frame(err))
        await websocket.close(TRY_AGAIN_LATER)
        return
    chat.connections += 1
    try:
        await ChatSocket(websocket, chat).run()
    finally:
        chat.connections -= 1
