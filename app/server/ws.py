"""/ws: one receive loop per connection; each turn streams from a task of its own.

Several conversations share a connection, and several turns run at once across them (one
per conversation). Frames of different turns interleave; each turn's frames stay in order
and end with exactly one `done` or `error`. A turn runs apart from its socket (see
app.server.turn_runner and app.server.streams): a closed socket *detaches* its turns, which
run on for the grace period and can be resumed on another socket with a `resume` frame;
with a grace period of 0 they are cancelled at once, within one engine step. Turn ids are
the client's; a turn is found again by its conversation and id.

Backpressure: a turn waits for its socket to take each frame, so a client that reads slowly
holds up its own turns, and meanwhile the engine's outputs for them merge into bigger
deltas (AsyncEngine.generate) instead of piling up as a backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from app.server import protocol as p
from app.server.security import CLIENT_COOKIE, Principal
from app.server.shares import Share
from app.server.streams import TurnStream
from app.server.turn_runner import TurnRunner

log = logging.getLogger(__name__)


class ChatSocket:
    """One WebSocket connection and the turns streaming to it (a Sink of their streams)."""

    def __init__(self, websocket: WebSocket, runner: TurnRunner, principal: Principal) -> None:
        self.ws = websocket
        self.runner = runner
        self.chat = runner.chat
        self.principal = principal
        self.turns: dict[str, TurnStream] = {}  # by the client's turn id
        self._send_lock = asyncio.Lock()
        self._closed = False
        self._active = time.monotonic()  # the last frame received, or turn ended

    async def run(self) -> None:
        headers = []
        if self.principal.new_client_cookie:  # a new lineage: clients that keep cookies keep it
            value = self.principal.new_client_cookie
            cookie = f"{CLIENT_COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict"
            cookie += "; Secure" if self.ws.url.scheme == "wss" else ""
            headers.append((b"set-cookie", cookie.encode()))
        await self.ws.accept(headers=headers)
        try:
            while True:
                message = await self._receive()
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
                except Exception:  # ours, not the client's: say so, and keep the socket
                    log.exception("a /ws frame failed")
                    internal = p.ProtocolError(p.INTERNAL, "the server failed this frame")
                    await self.send(p.error_frame(internal))
        except WebSocketDisconnect:
            pass
        finally:
            self._closed = True
            await self._detach_all()

    async def _receive(self) -> Message:
        """The next message. A socket that carries no turn and has sent nothing for the
        idle timeout (measured from its last frame or turn) is closed with 1000: sockets
        left open and idle must not hold their client's share."""
        idle = self.chat.config.idle_timeout_s
        while True:
            left = idle if self.turns else idle - (time.monotonic() - self._active)
            try:
                async with asyncio.timeout(max(left, 0.0)):
                    message = await self.ws.receive()
            except TimeoutError:
                if self.turns or time.monotonic() - self._active < idle:
                    continue
                with contextlib.suppress(Exception):
                    await self.ws.close(1000, f"idle for {idle:g} s")
                return {"type": "websocket.disconnect"}
            self._active = time.monotonic()
            return message

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

    def release(self, stream: TurnStream) -> None:
        """A turn no longer streams here (it ended, or another socket resumed it)."""
        if self.turns.get(stream.id) is stream:
            del self.turns[stream.id]
            self._active = time.monotonic()

    async def _handle(self, frame: p.Frame) -> None:
        if isinstance(frame, p.PingFrame):
            await self.send(p.pong_frame())
        elif isinstance(frame, p.CancelFrame):
            stream = self.turns.get(frame.id)
            if stream is None:
                raise p.ProtocolError(p.UNKNOWN_ID, f"no turn {frame.id!r} is in flight", frame.id)
            # A turn that finished but whose terminal frame is still on its way here is in
            # flight for the client: the cancel is a no-op, the done that follows says how
            # it ended (an error now would be a second terminal frame for the id).
            stream.cancel()  # ends with finish_reason "cancelled"; nothing once finished
        elif isinstance(frame, p.DeleteFrame):
            self.chat.check_access(self.principal, frame.conversation_id, None)
            # Cancel first: the engine applies the abort (whose blocks go to the pin) before
            # the release (which frees the pin), in the order they were sent.
            self.runner.cancel_conversation(self.principal, frame.conversation_id)
            self.chat.delete(self.principal, frame.conversation_id)
            await self.send(p.deleted_frame(frame.conversation_id))
        elif isinstance(frame, p.ChatFrame):
            await self._start_turn(frame)
        elif isinstance(frame, p.ResumeFrame):
            await self._resume(frame)

    async def _start_turn(self, frame: p.ChatFrame) -> None:
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
        self.turns[frame.id] = await self.runner.start(frame, self.principal, self)

    async def _resume(self, frame: p.ResumeFrame) -> None:
        here = self.turns.get(frame.id)
        if here is not None and here.conversation_id != frame.conversation_id:
            raise p.ProtocolError(
                p.DUPLICATE_ID, f"turn {frame.id!r} of another conversation is in flight", frame.id
            )
        stream = await self.runner.resume(frame, self.principal, self)  # raises
        self.turns[frame.id] = stream

    async def _detach_all(self) -> None:
        streams = list(self.turns.values())
        self.turns.clear()
        if streams:
            log.info("connection closed: detaching %d turn(s) in flight", len(streams))
        for stream in streams:
            stream.detach(self)
        if self.ws.client_state is WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await self.ws.close()


# Close codes (RFC 6455): policy violation, and "try again later".
POLICY_VIOLATION = 1008
TRY_AGAIN_LATER = 1013


class Connections:
    """Open /ws sockets: at most `limit` in all, and each client's share of them
    (app.server.shares). Event-loop only."""

    def __init__(self, limit: int, per_client: int) -> None:
        self.open = 0
        self.limit = limit
        self.per_client = Share(per_client)

    def admit(self, principal: Principal) -> str | None:
        """Take a place for the principal's new socket; why not, when there is none."""
        if self.open >= self.limit:
            return f"too many connections (at most {self.limit})"
        if not self.per_client.take(principal.share):
            return (f"this client has {self.per_client.limit} connections open, its share "
                    "(--max-connections-per-client)")  # fmt: skip
        self.open += 1
        return None

    def leave(self, principal: Principal) -> None:
        self.open -= 1
        self.per_client.release(principal.share)


async def ws_endpoint(websocket: WebSocket) -> None:
    runner: TurnRunner = websocket.state.turns
    connections: Connections = websocket.state.connections
    principal = websocket.user
    if not isinstance(principal, Principal):  # a key is required and none was given
        await websocket.close(POLICY_VIOLATION)
        return
    refused = connections.admit(principal)
    if refused is not None:
        await _busy(websocket, refused)
        return
    try:
        await ChatSocket(websocket, runner, principal).run()
    finally:
        connections.leave(principal)


async def _busy(websocket: WebSocket, why: str) -> None:
    await websocket.accept()
    err = p.ProtocolError(p.BUSY, f"{why}; retry shortly", retryable=True)
    await websocket.send_text(p.error_frame(err))
    await websocket.close(TRY_AGAIN_LATER)
