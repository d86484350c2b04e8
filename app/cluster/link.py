"""The token path beside Ray: one TCP connection between a front and each replica.

Ray places the replicas, restarts them and carries the control calls (info, opening a
link, a heartbeat while there is no link). The hot path (a request in, every engine
step's outputs out) and the steady heartbeat take a socket of their own, as vLLM's engine
core takes ZeroMQ sockets beside its processes: a Ray streaming-generator item costs the
front ~250-400 us of CPU and a Ray call ~0.4-1 ms, a frame on an open socket a few
microseconds.

A front asks a replica to open its end (`ReplicaLinks.open`, over Ray): the replica
listens on an ephemeral port (loopback when the front is on the same node, else its node's
address) and hands back the address with a fresh random key. The front connects and sends
the key first; anything else is closed unread. Then:

    front -> replica   ("submit", EngineRequest) | ("abort", request id)
                       | ("release", session id): its pinned K/V may go
    replica -> front   list[Relayed]: what the replica produced since the previous frame
                       | ReplicaBeat: its counters and cached block hashes, every
                         `beat_s` seconds (the front's heartbeat, with no Ray call):
                         the first whole, then what changed since the one before

Each frame is a 4-byte big-endian length and a pickle. The key is what lets the replica
unpickle what arrives (Ray's own channel, which hands over the key, is token-authenticated);
the front unpickles only what comes from the address its replica gave it. One ordered
connection per front also means an abort can never overtake its submit.

When the connection ends (the replica died, or the front went away), the front resumes
the replica's requests elsewhere (cluster.py), and the replica aborts what was submitted
over it: nobody is left to read those outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from app.engine.engine_request import EngineRequest
from app.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

HEADER = struct.Struct("!I")
KEY_BYTES = 32
HELLO_TIMEOUT_S = 10.0  # for a connection to send its key
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Beat:
    """What a front asks of a replica's heartbeat over the link."""

    every_s: float
    max_hashes: int  # cached block hashes it carries, the most recent


@dataclass(frozen=True)
class LinkAddress:
    """Where a front connects to reach one replica, and the key it must present."""

    host: str
    port: int
    key: bytes


def frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; asyncio.IncompleteReadError once the other end is gone."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


class LinkBody(Protocol):
    """What a replica (real or simulated) offers its links."""

    def submit(self, front: str, asked: EngineRequest) -> None: ...
    def heartbeat(self, max_hashes: int, published: set[bytes] | None = None) -> Any: ...
    def abort(self, request_id: str) -> None: ...
    def release_session(self, session_id: str) -> None: ...
    def stream(self, front: str) -> AsyncIterator[list[Any]]: ...


class ReplicaLinks:
    """A replica's ends of its fronts' links: one listener and one connection per front."""

    def __init__(self, body: LinkBody) -> None:
        self._body = body
        self._listeners: dict[str, tuple[asyncio.Server, LinkAddress]] = {}
        self._serving: dict[str, asyncio.Task[None]] = {}  # front -> its connection's task

    async def open(self, front: str, host: str, beat: Beat | None = None) -> LinkAddress:
        """Listen for `front` on `host` (once; later calls give the same address). With
        `beat`, the connection carries the replica's heartbeat too."""
        known = self._listeners.get(front)
        if known is not None:
            return known[1]
        key = secrets.token_bytes(KEY_BYTES)

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._accept(front, key, reader, writer, beat)

        server = await asyncio.start_server(accept, host, 0)
        port = server.sockets[0].getsockname()[1]
        address = LinkAddress(host, port, key)
        self._listeners[front] = (server, address)
        return address

    async def close(self) -> None:
        for server, _ in self._listeners.values():
            server.close()
        for task in list(self._serving.values()):
            task.cancel()
        self._listeners.clear()

    async def _accept(
        self,
        front: str,
        key: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        beat: Beat | None,
    ) -> None:
        try:
            hello = await asyncio.wait_for(reader.readexactly(KEY_BYTES), HELLO_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            hello = b""
        if not hmac.compare_digest(hello, key):
            log.warning("closed a link connection that did not present its key")
            writer.close()
            return
        earlier = self._serving.pop(front, None)
        if earlier is not None:  # the front reconnected: the new connection takes over
            earlier.cancel()
        task = asyncio.current_task()
        assert task is not None
        self._serving[front] = task
        try:
            await self._serve(front, reader, writer, beat)
        finally:
            if self._serving.get(front) is task:
                del self._serving[front]
            writer.close()

    async def _serve(
        self,
        front: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        beat: Beat | None,
    ) -> None:
        open_ids: set[str] = set()  # submitted over this connection and not yet ended
        loop = asyncio.get_running_loop()
        sender = loop.create_task(self._send(front, writer, open_ids))
        beater = loop.create_task(self._beat(writer, beat)) if beat is not None else None
        try:
            while True:
                kind, payload = await read_frame(reader)
                if kind == "submit":
                    open_ids.add(payload.request_id)
                    self._body.submit(front, payload)
                elif kind == "abort":
                    self._body.abort(payload)
                elif kind == "release":
                    self._body.release_session(payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front went away
        finally:
            for task in (sender, beater):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            for request_id in open_ids:  # nobody reads their outputs any more
                self._body.abort(request_id)

    async def _beat(self, writer: asyncio.StreamWriter, beat: Beat) -> None:
        """The replica's heartbeat, a frame every `beat.every_s` (a whole frame a write:
        it never splits one of _send's). `published`: the block hashes this connection's
        beats have told, so that each carries only what changed (ReplicaBeat.of)."""
        published: set[bytes] = set()
        while not writer.is_closing():
            writer.write(frame(self._body.heartbeat(beat.max_hashes, published)))
            await asyncio.sleep(beat.every_s)

    async def _send(self, front: str, writer: asyncio.StreamWriter, open_ids: set[str]) -> None:
        try:
            async for items in self._body.stream(front):
                for request_id, item in items:
                    if not isinstance(item, RequestOutput):  # its end
                        open_ids.discard(request_id)
                writer.write(frame(items))
                await writer.drain()
        except ConnectionError:
            pass


class FrontLink:
    """The front's end of its link to one replica."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self._writer = writer

    @classmethod
    async def connect(cls, address: LinkAddress) -> FrontLink:
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(address.key)
        return cls(reader, writer)

    def submit(self, asked: EngineRequest) -> None:
        self._send(("submit", asked))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def release_session(self, session_id: str) -> None:
        self._send(("release", session_id))

    async def batches(self) -> AsyncIterator[list[Any]]:
        """Every frame the replica sends, until the connection ends."""
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                yield await read_frame(self.reader)

    def close(self) -> None:
        self._writer.close()

    def _send(self, message: Any) -> None:
        if self._writer.is_closing():
            raise ConnectionError("the link to the replica is closed")
        self._writer.write(frame(message))
