"""/ws: one receive loop per connection; each turn streams from its own task.

Several conversations share a connection, and several turns run at once across them (one
per conversation). Frames of different turns interleave; each turn's frames stay in order
and end with exactly one `done` or `error`. A closed socket cancels its turns: their
requests are aborted within one engine step (their K/V stays pinned to the conversation).
Turn ids are the client's and mean something only on their own socket.

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

from app.engine.outputs import RequestOutput
from app.engine.request import FinishReason
from app.server import protocol as p
from app.server.chat_service import ChatService, Turn
from app.server.errors import ENGINE_ERRORS, ws_error
from app.server.security import CLIENT_COOKIE, Access, Principal

log = logging.getLogger(__name__)


@dataclass
class ActiveTurn:
    turn: Turn
    request_id: str  # the engine's id: unique across connections, unlike the client's
    task: asyncio.Task[None] | None = None


class ChatSocket:
    """One WebSocket connection and its turns in flight."""

    def __init__(self, websocket: WebSocket, chat: ChatService, principal: Principal) -> None:
        self.ws = websocket
        self.chat = chat
        self.principal = principal
        self.turns: dict[str, ActiveTurn] = {}  # by the client's turn id
        self._send_lock = asyncio.Lock()
        self._closed = False

    async def run(self) -> None:
        headers = []
        if self.principal.new_client_cookie:  # a new lineage: clients that keep cookies keep it
            value = self.principal.new_client_cookie
            cookie = f"{CLIENT_COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict"
            headers.append((b"set-cookie", cookie.encode()))
        await self.ws.accept(headers=headers)
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
            self.chat.delete(self.principal, frame.conversation_id)  # raises if not ours
            for active in self.turns.values():
                if active.turn.frame.conversation_id == frame.conversation_id:
                    self.chat.engine.abort(active.request_id)
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
        turn = self.chat.begin_turn(frame, self.principal)  # raises: busy, forbidden
        active = ActiveTurn(turn, uuid.uuid4().hex)
        self.turns[frame.id] = active
        active.task = asyncio.create_task(self._stream(active))

    async def _stream(self, active: ActiveTurn) -> None:
        """Run one turn: its frames, then exactly one terminal frame (unless the socket
        is gone). Whatever happens, the turn ends in the `finally`."""
        turn, frame = active.turn, active.turn.frame
        reply: list[str] = []
        reply_ids: list[int] = []
        last: RequestOutput | None = None
        started = False
        terminal: str | None = None
        try:
            prompt_ids = await self.chat.prompt_ids(turn)
            stream = self.chat.engine.generate(
                prompt_ids,
                frame.params,
                active.request_id,
                turn.conversation.key if frame.cache else None,
                use_prefix_cache=frame.cache,  # False: every turn computes its whole prompt
                cache_salt=self.chat.cache_salt(self.principal),
            )
            seq = 0
            async for out in stream:
                last = out
                reply_ids += out.new_token_ids
                if not started:
                    started = await self._send_start(frame, out)
                if out.new_text:
                    reply.append(out.new_text)
                    if not await self.send(p.token_frame(frame.id, seq, out.new_text)):
                        break  # the client is gone: leaving the loop aborts the request
                    seq += 1
            if last is not None and last.finish_reason is FinishReason.ERROR:
                terminal = p.error_frame(
                    p.ProtocolError(p.INTERNAL, "the engine failed this turn", frame.id, True)
                )
            elif last is not None and last.finished:
                if not started:
                    await self._send_start(frame, last)
                reason = (
                    "cancelled"
                    if last.finish_reason is FinishReason.ABORT
                    else str(last.finish_reason)
                )
                self.chat.log_turn(turn, last, reason)
                usage, timings = self.chat.usage(last), self.chat.timings(last)
                terminal = p.done_frame(frame.id, reason, usage, timings)
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
            self.turns.pop(frame.id, None)
        if terminal is not None:
            await self.send(terminal)

    async def _send_start(self, frame: p.ChatFrame, out: RequestOutput) -> bool:
        return await self.send(
            p.start_frame(
                frame.id,
                frame.conversation_id,
                out.prompt_tokens,
                out.cached_tokens,
                out.tier_cached_tokens,
            )
        )

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
    access: Access = websocket.state.access
    chat: ChatService = websocket.state.chat
    if not access.origin_ok(websocket.headers, websocket.url.scheme):
        log.warning("refused a /ws handshake from origin %s", websocket.headers.get("origin"))
        await websocket.close(POLICY_VIOLATION)  # before accept: the handshake gets a 403
        return
    principal = websocket.user
    if not isinstance(principal, Principal):  # a key is required and none was given
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
        await ChatSocket(websocket, chat, principal).run()
    finally:
        chat.connections -= 1
