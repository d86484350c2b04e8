"""One engine replica: an AsyncEngine in a Ray actor process of its own.

A front opens a link to it (`open_link`, over Ray; link.py) and then submits requests and
reads their outputs over that socket, not through Ray: `submit` queues a request, and
`stream` gives everything the replica produced for that front since the last item,
usually one engine step's outputs for all of its requests, which the link sends as one
frame. A request's outputs end with its frozen stats (FinishedRequestStats, for the
front's metrics and tracing), or None when there are none, or the exception that refused
it (bad input, overloaded).

`heartbeat` is the replica's sign of life: the engine's counters and the hashes of the KV
blocks this replica holds, for prefix-aware routing (router.py). Its link sends one every
second; the front calls it over Ray only for a replica it has no link to.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from app.cluster.link import LOOPBACK, Beat, LinkAddress, ReplicaLinks
from app.config import EngineConfig
from app.engine.async_engine import AsyncEngine, settle_heap
from app.engine.engine_request import EngineRequest
from app.engine.outputs import EngineStats, FinishedRequestStats, ModelInfo, RequestOutput
from app.model.loader import LoadedModel

# One relayed item: (request id, an output | the request's end: its stats, None, an error)
Relayed = tuple[str, RequestOutput | FinishedRequestStats | BaseException | None]
EARLY_ABORTS = 1024  # aborts remembered for requests not (yet) submitted


@dataclass(frozen=True)
class ReplicaBeat:
    """A replica's answer to the front's ping: its counters and the hashes of the KV
    blocks it holds; whole, or (`whole` False) what changed since the previous beat on
    the same link.

    Whole, a beat of 4,096 hashes is ~78 KB a second from each replica, and unpickling
    it into a set cost the front ~0.3-0.5 ms each: a front's CPU that grew with every
    replica. A link is one ordered connection, so each beat on it can carry only the
    blocks cached and let go since the one before. It is whole while the link has told
    nothing yet (its first beat, or one after every block was let go)."""

    stats: EngineStats
    block_hashes: tuple[bytes, ...]  # whole: those it holds; else those newly cached
    dropped: tuple[bytes, ...] = ()  # not whole: those it no longer holds
    whole: bool = True

    @classmethod
    def of(
        cls, stats: EngineStats, hashes: list[bytes], published: set[bytes] | None = None
    ) -> ReplicaBeat:
        """The beat for `hashes` held now: whole, or with `published` (what this link's
        earlier beats told, updated here) only the change, unless they told nothing."""
        if published is None:
            return cls(stats, tuple(hashes))
        held = set(hashes)
        if not published:
            published |= held
            return cls(stats, tuple(hashes))
        added, dropped = held - published, published - held
        published -= dropped
        published |= added
        return cls(stats, tuple(added), tuple(dropped), whole=False)


@dataclass
class Outbox:
    """What one front has not read yet."""

    items: list[Relayed] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: Relayed) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list[Relayed]:
        """Everything queued, once there is something. Outputs of one step are queued
        by their requests' tasks before this one runs again, so they leave together."""
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items


def link_host(front_ip: str) -> str:
    """Where a replica listens for a front at `front_ip`: loopback on the same node."""
    import ray  # only ever run inside a Ray actor

    own = ray.util.get_node_ip_address()
    return LOOPBACK if front_ip == own else own


class Replica:
    """The actor's body (wrapped by ray.remote in cluster.py)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.engine = AsyncEngine.build(config, loaded)  # see AsyncEngine's docstring
        self._finished: dict[str, FinishedRequestStats] = {}
        self._outboxes: dict[str, Outbox] = {}  # front id -> its unread outputs
        self._tasks: dict[str, asyncio.Task[None]] = {}  # request id -> its relay
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._links = ReplicaLinks(self)
        self.engine.add_listener(self)
        self.engine.start()
        settle_heap()  # the actor's process is this replica's alone, as the server's is

    # EngineListener, on the engine's thread: keep each request's final stats for its stream.
    def on_tokens(self, request_id: str, num_tokens: int, gap_s: float | None) -> None:
        pass

    def on_finished(self, stats: FinishedRequestStats) -> None:
        self._finished[stats.request_id] = stats

    def info(self) -> ModelInfo:
        return self.engine.info

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray  # only ever run inside a Ray actor

        return ray.get_runtime_context().get_node_id()

    def healthy(self) -> bool:
        return self.engine.healthy()

    async def open_link(self, front: str, front_ip: str, beat: Beat | None = None) -> LinkAddress:
        return await self._links.open(front, link_host(front_ip), beat)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def heartbeat(self, max_hashes: int, published: set[bytes] | None = None) -> ReplicaBeat:
        """Whole over Ray; over a link, what changed since its last beat (ReplicaBeat.of)."""
        hashes = self.engine.engine.kv.pool.cached_hashes(max_hashes)
        return ReplicaBeat.of(self.engine.stats(), hashes, published)

    def submit(self, front: str, asked: EngineRequest) -> None:
        """Queue a request; its outputs go to `front`'s stream."""
        asyncio.get_running_loop().create_task(self._run(self._outbox(front), asked))

    async def stream(self, front: str) -> AsyncIterator[list[Relayed]]:
        """Every output for `front`'s requests, batched by step, for as long as it reads."""
        box = self._outbox(front)
        while True:
            yield await box.take()

    def abort(self, request_id: str) -> None:
        if request_id not in self._tasks:
            self._early_aborts[request_id] = None
            while len(self._early_aborts) > EARLY_ABORTS:
                self._early_aborts.popitem(last=False)
        self.engine.abort(request_id)

    def release_session(self, session_id: str) -> None:
        self.engine.release_session(session_id)

    async def stop(self) -> None:
        await self._links.close()
        await self.engine.stop()

    # -- inside ------------------------------------------------------------------------------

    def _outbox(self, front: str) -> Outbox:
        box = self._outboxes.get(front)
        if box is None:
            box = self._outboxes[front] = Outbox()
        return box

    async def _run(self, box: Outbox, asked: EngineRequest) -> None:
        request_id = asked.request_id
        if request_id in self._early_aborts:  # cancelled before it got here
            del self._early_aborts[request_id]
            box.put((request_id, None))
            return
        # From here until its first output the engine holds the abort (AsyncEngine).
        self._tasks[request_id] = asyncio.current_task()  # type: ignore[assignment]
        end: FinishedRequestStats | BaseException | None = None
        try:
            async for out in self.engine.generate(asked):
                box.put((request_id, out))
        except Exception as exc:  # refused (bad input, overloaded): the front raises it
            end = exc
        finally:
            stats = self._finished.pop(request_id, None)
            self._tasks.pop(request_id, None)
        box.put((request_id, stats if end is None else end))
