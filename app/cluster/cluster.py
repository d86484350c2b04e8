"""RayCluster: N engine replicas as Ray actors, behind the EngineClient surface.

The front (this process: the page, /ws, /v1, /metrics) routes each request to a replica
(router.py: a conversation sticks to the replica holding its K/V unless that one is
loaded past a threshold), sends it over its link to that replica and reads the outputs
back from it (link.py: one socket per replica beside Ray, one frame per engine step). A
cancel, or a client that leaves, reaches the replica as an abort within one engine step.

A replica that dies mid-stream: the request is resubmitted to a live replica as its
prompt plus the tokens already sent, and the stream goes on where it was (the prefix
cache, or the shared KV tier, makes the recompute cheap); the client sees one continuous
reply. Ray restarts the dead actor (it loads the model again); until it answers, the
router leaves it out. With no live replica a request fails with EngineDead (retryable).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from app.cluster.link import Beat, FrontLink, LinkAddress
from app.cluster.replica import Replica, ReplicaBeat
from app.cluster.router import Router, prompt_block_hashes
from app.cluster.simulated import SimulatedReplica
from app.config import INLINE_TEXT_CHARS, ClusterConfig, EngineConfig
from app.engine.continuation import Continuation
from app.engine.engine_request import EngineRequest
from app.engine.errors import EngineDead
from app.engine.outputs import (
    EngineListener,
    EngineStats,
    FinishedRequestStats,
    ModelInfo,
    ReplicaStats,
    RequestOutput,
)
from app.model.loader import LoadedModel

log = logging.getLogger(__name__)

REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
MONITOR_INTERVAL_S = 1.0
PING_TIMEOUT_S = 5.0
PUBLISHED_BLOCKS = 4096  # block hashes a replica publishes with each heartbeat
MAX_SESSIONS = 100_000  # sessions whose replicas are remembered (to release their pins)
_GONE = object()  # queued to a request whose replica's stream broke


class ReplicaLost(Exception):
    """The stream of the replica serving a request broke (the replica or its node died)."""


class RayCluster:
    """Engine replicas on Ray with conversation affinity (an EngineClient)."""

    def __init__(
        self,
        config: EngineConfig,
        cluster: ClusterConfig,
        loaded: LoadedModel | None = None,
    ) -> None:
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(
                address=cluster.ray_address,
                num_cpus=None if cluster.ray_address else os.cpu_count(),
                include_dashboard=False,
                configure_logging=False,
                log_to_driver=True,
            )
        n = cluster.replicas
        threads = cluster.threads_per_replica or max(1, (os.cpu_count() or 1) // n)
        simulated = cluster.simulate_steps_per_s is not None
        cpus = ray.cluster_resources().get("CPU", 0)
        if not simulated and cpus < n * threads:
            raise ValueError(
                f"{n} replicas of {threads} threads need {n * threads} CPUs; the Ray "
                f"cluster has {cpus:g}"
            )
        body = SimulatedReplica if simulated else Replica
        actor = ray.remote(body).options(
            num_cpus=0 if simulated else threads,  # a simulated one computes nothing
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=1000,
        )
        # --threads pins each replica's count; else each chooses its own (app.engine.threads)
        # within its share, fewer while its CPUs are contended.
        per_replica = dataclasses.replace(
            config, num_threads=cluster.threads_per_replica, max_threads=threads
        )
        # Held for as long as the cluster lives: Ray restarts a dead replica from them.
        self._replica_args: tuple[Any, ...] = (ray.put(per_replica), ray.put(loaded))
        if simulated:
            self._replica_args += (cluster.simulate_steps_per_s,)
        self.replicas = [actor.remote(*self._replica_args) for _ in range(n)]
        self._info: ModelInfo = ray.get(self.replicas[0].info.remote())
        ray.get([r.healthy.remote() for r in self.replicas])
        self.router = Router(cluster.rebalance_threshold, cluster.min_prefix_blocks)
        self._block_size = config.cache.block_size
        self._front = uuid.uuid4().hex  # this front's name on the replicas' links
        self._front_ip = ray.util.get_node_ip_address()
        self._inboxes: dict[str, asyncio.Queue[Any]] = {}  # request id -> its outputs
        self._relays: dict[int, asyncio.Task[None]] = {}  # replica -> its link's reader
        self._links: dict[int, asyncio.Future[FrontLink]] = {}  # replica -> its link
        self._lost_at: dict[int, float] = {}  # replica -> when its stream last broke
        self._answered_at = dict.fromkeys(range(n), time.monotonic())  # its last heartbeat
        self._beat_at: dict[int, float] = {}  # replica -> its link's last heartbeat
        self._stall_s = cluster.stall_s
        self._visited: OrderedDict[str, set[int]] = OrderedDict()  # session -> its replicas
        self.live: set[int] = set(range(n))
        self.in_flight = dict.fromkeys(range(n), 0)
        self._stats: dict[int, EngineStats] = {}
        self._where: dict[str, int] = {}  # request id -> the replica serving it
        self._listeners: list[EngineListener] = []
        self._monitor: asyncio.Task[None] | None = None
        self._stopping = False
        self.resumed = 0  # requests taken up by another replica after theirs was lost
        log.info("%d engine replicas on Ray, %s %d threads each", n,
                 "pinned to" if cluster.threads_per_replica else "up to", threads)  # fmt: skip

    # -- EngineClient ----------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self._info

    def start(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        self._stopping = True
        for task in [self._monitor, *self._relays.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for replica in self.replicas:
            ray.kill(replica, no_restart=True)
        if self._owns_ray:
            ray.shutdown()

    def healthy(self) -> bool:
        return bool(self.live) and not self._stopping

    def add_listener(self, listener: EngineListener) -> None:
        self._listeners.append(listener)

    def abort(self, request_id: str) -> None:
        replica = self._where.get(request_id)
        if replica is not None:
            self._abort(replica, request_id)

    def release_session(self, session_id: str) -> None:
        # It may have pins on any replica it visited (all, once forgotten which).
        visited = self._visited.pop(session_id, self.live)
        for replica in visited & self.live:
            link = self._open_link(replica)
            if link is None:
                self.replicas[replica].release_session.remote(session_id)
            else:
                with contextlib.suppress(ConnectionError):
                    link.release_session(session_id)
        self.router.forget(session_id)

    def stats(self) -> EngineStats:
        known = [self._stats[i] for i in sorted(self._stats)]
        total = lambda name: sum(getattr(s, name) for s in known)  # noqa: E731
        unpins: dict[str, int] = {}
        for s in known:
            for reason, count in s.session_unpins.items():
                unpins[reason] = unpins.get(reason, 0) + count
        blocks = total("num_blocks")
        return EngineStats(
            num_running=total("num_running"),
            num_waiting=total("num_waiting"),
            kv_usage=(blocks - total("num_free_blocks")) / blocks if blocks else 0.0,
            num_free_blocks=total("num_free_blocks"),
            num_blocks=blocks,
            num_preemptions=total("num_preemptions"),
            prefix_queries=total("prefix_queries"),
            prefix_hits=total("prefix_hits"),
            pin_hits=total("pin_hits"),
            sessions_pinned=total("sessions_pinned"),
            pinned_blocks=total("pinned_blocks"),
            session_unpins=unpins,
            steps=total("steps"),
            itl_gaps=total("itl_gaps"),
            thread_changes=total("thread_changes"),
            itl_gaps_over=tuple(map(sum, zip(*(s.itl_gaps_over for s in known)))),
            replicas=tuple(self._replica_stats(i) for i in range(len(self.replicas))),
            routing=dict(self.router.decisions),
        )

    async def generate(self, asked: EngineRequest) -> AsyncIterator[RequestOutput]:
        if not self.healthy():
            raise EngineDead("no engine replica is running; retry shortly")
        request_id, params, session_id = asked.request_id, asked.params, asked.session_id
        ids = await self._token_ids(asked.prompt)
        key = session_id or asked.routing_key
        hashes = None if key else prompt_block_hashes(ids, asked.cache_salt, self._block_size)
        sent: list[int] = []  # output token ids already passed on
        first: RequestOutput | None = None
        tried = 0
        last_token_at: float | None = None
        while True:
            loads = {i: self.in_flight[i] for i in self.live}
            if not loads:
                raise EngineDead("no engine replica is running; retry shortly")
            if hashes is None:
                replica, _ = self.router.pick(key, loads)
            else:
                replica, _ = self.router.pick_by_prefix(hashes, loads)
            # A request cut after `sent` tokens (its replica died) goes on from them.
            cont = Continuation.of(ids, sent, params)
            if cont is None:
                return  # its budget was spent: nothing more comes
            inbox: asyncio.Queue[Any] = asyncio.Queue()
            self._inboxes[request_id] = inbox
            self.in_flight[replica] += 1
            self._where[request_id] = replica
            if session_id is not None:
                self._visit(session_id, replica)
            open_choices, ended = params.n, False
            try:
                link = await self._link(replica)
                link.submit(cont.request(asked))
                while not ended:
                    for item in _merged(await inbox.get(), inbox):
                        if isinstance(item, RequestOutput):
                            open_choices -= item.finished
                            cached = first.cached_tokens if first is not None else None
                            out = cont.output(item, cached)
                            first = first or out
                            sent += item.new_token_ids
                            if item.new_token_ids:
                                now = time.monotonic()
                                gap = None if last_token_at is None else now - last_token_at
                                last_token_at = now
                                for listener in self._listeners:
                                    listener.on_tokens(request_id, len(item.new_token_ids), gap)
                            yield out
                        elif item is _GONE:
                            raise ReplicaLost(replica)
                        elif isinstance(item, BaseException):  # refused: bad input, busy
                            raise item
                        else:  # the request's end: its stats, or None
                            ended = True
                            if item is not None:
                                cached = first.cached_tokens if first is not None else None
                                self._tell_finished(cont.stats(item, cached))
                            break
                return
            except (*REPLICA_GONE, ReplicaLost, ConnectionError):
                tried += 1
                self.resumed += 1
                self._lost(replica)
                log.warning(
                    "replica %d was lost (died or stalled) serving %s; resuming it "
                    "elsewhere after %d tokens",
                    replica, request_id, len(sent),
                )  # fmt: skip
                if tried > len(self.replicas):
                    raise EngineDead("engine replicas keep failing; retry shortly") from None
            finally:
                self.in_flight[replica] -= 1
                if open_choices > 0 and not ended and replica in self.live:
                    # Left early (a cancel, a client gone): stop the work where it runs.
                    self._abort(replica, request_id)
                if self._where.get(request_id) == replica:
                    del self._where[request_id]
                if self._inboxes.get(request_id) is inbox:
                    del self._inboxes[request_id]

    # -- inside ------------------------------------------------------------------------------

    async def _token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids on the front's side: a request resumed on another replica needs
        them, and routing by a prompt's start does too."""
        if not isinstance(prompt, str):
            return list(prompt)
        encode = self._info.tokenizer.encode
        if len(prompt) > INLINE_TEXT_CHARS:
            return await asyncio.to_thread(encode, prompt, add_special_tokens=False)
        return encode(prompt, add_special_tokens=False)

    def _tell_finished(self, stats: FinishedRequestStats) -> None:
        for listener in self._listeners:
            listener.on_finished(stats)

    def _replica_stats(self, i: int) -> ReplicaStats:
        s = self._stats.get(i)
        return ReplicaStats(
            name=str(i),
            live=i in self.live,
            in_flight=self.in_flight[i],
            num_running=s.num_running if s else 0,
            num_waiting=s.num_waiting if s else 0,
            kv_usage=s.kv_usage if s else 0.0,
            cpu_threads=s.cpu_threads if s else 0,
        )

    def _visit(self, session_id: str, replica: int) -> None:
        self._visited.setdefault(session_id, set()).add(replica)
        self._visited.move_to_end(session_id)
        while len(self._visited) > MAX_SESSIONS:
            self._visited.popitem(last=False)

    def _abort(self, i: int, request_id: str) -> None:
        """Stop `request_id` where it runs on replica i (after its submit: one link)."""
        link = self._open_link(i)
        if link is not None:
            with contextlib.suppress(ConnectionError):
                link.abort(request_id)

    def _open_link(self, i: int) -> FrontLink | None:
        ready = self._links.get(i)
        if ready is None or not ready.done() or ready.cancelled() or ready.exception():
            return None
        return ready.result()

    def _relay(self, i: int) -> None:
        """Open replica i's link and read it (once per replica and life of its actor)."""
        if i not in self._relays:
            self._links[i] = asyncio.get_running_loop().create_future()
            self._relays[i] = asyncio.get_running_loop().create_task(self._read_link(i))

    async def _link(self, i: int) -> FrontLink:
        """Replica i's link, once it is open (ReplicaLost if it cannot be)."""
        self._relay(i)
        return await asyncio.shield(self._links[i])

    async def _read_link(self, i: int) -> None:
        """One frame per engine step of replica i (its outputs for all of this front's
        requests), fanned out to the requests' inboxes. When the link breaks, every
        request the replica was serving resumes elsewhere."""
        ready = self._links[i]
        link: FrontLink | None = None
        try:
            try:
                address: LinkAddress = await self.replicas[i].open_link.remote(
                    self._front, self._front_ip, Beat(MONITOR_INTERVAL_S, PUBLISHED_BLOCKS)
                )
                link = await FrontLink.connect(address)
            except (*REPLICA_GONE, OSError) as exc:
                raise ReplicaLost(i) from exc
            ready.set_result(link)
            opened = self._beat_at[i] = time.monotonic()
            inboxes, where = self._inboxes, self._where
            async for batch in link.batches():
                if isinstance(batch, ReplicaBeat):
                    if self._lost_at.get(i, 0.0) < opened:  # not a link already given up
                        self._beat_at[i] = time.monotonic()
                        self._answered(i, batch)
                    continue
                for request_id, item in batch:
                    # Only the replica serving it now: a request moved off a link that
                    # broke may still have outputs on their way from the old one.
                    if where.get(request_id) == i:
                        inbox = inboxes.get(request_id)
                        if inbox is not None:
                            inbox.put_nowait(item)
        except asyncio.CancelledError:
            raise
        except ReplicaLost:
            pass
        except Exception:
            log.exception("the link of engine replica %d failed", i)
        finally:
            if link is not None:
                link.close()
            if not ready.done():  # never opened: whoever waits for it goes elsewhere
                ready.set_exception(ReplicaLost(i))
                ready.exception()  # retrieved: a link nobody waited for is no error
            if self._links.get(i) is ready:
                del self._links[i]
                self._beat_at.pop(i, None)
            del self._relays[i]
        if not self._stopping:
            self._lost(i)

    def _lost(self, i: int) -> None:
        """Replica i is gone (or not answering): route nothing to it, and move what it
        served."""
        self.live.discard(i)
        self._lost_at[i] = time.monotonic()
        self.router.drop(i)
        link = self._open_link(i)
        if link is not None:
            link.close()  # its reader ends; the next heartbeat opens a new one
        for request_id, replica in list(self._where.items()):
            if replica == i and request_id in self._inboxes:
                self._inboxes[request_id].put_nowait(_GONE)

    async def _watch(self) -> None:
        """Ping every replica (all at once: one that does not answer delays none of the
        others): who is live (a restarted actor comes back), and their counters for
        /metrics."""
        while True:
            await asyncio.gather(*(self._ping(i) for i in range(len(self.replicas))))
            await asyncio.sleep(MONITOR_INTERVAL_S)

    async def _ping(self, i: int) -> None:
        """Replica i's heartbeat: over its link when it has one (no Ray call: those cost
        the front ~0.4 ms of CPU each, half of what it spends with nothing to serve);
        else asked over Ray, which also opens the link."""
        beat_at = self._beat_at.get(i)
        if beat_at is not None:
            if time.monotonic() - beat_at >= PING_TIMEOUT_S:
                self._silent(i)
            return
        asked = time.monotonic()
        try:
            beat: ReplicaBeat = await asyncio.wait_for(
                _await(self.replicas[i].heartbeat.remote(PUBLISHED_BLOCKS)), PING_TIMEOUT_S
            )
        except TimeoutError:
            self._silent(i)
            return
        except REPLICA_GONE:
            self._lost(i)
            return
        self._answered_at[i] = time.monotonic()
        if self._lost_at.get(i, 0.0) > asked:
            return  # it answered before it was lost: not a sign of life
        self._relay(i)
        if i not in self._beat_at:  # else its link opened meanwhile: its beats tell, in order
            self._answered(i, beat)

    def _answered(self, i: int, beat: ReplicaBeat) -> None:
        self._answered_at[i] = time.monotonic()
        if i not in self.live:
            log.info("engine replica %d is live", i)
        self.live.add(i)
        self._stats[i] = beat.stats
        if beat.whole:
            self.router.publish(i, beat.block_hashes)
        else:  # over its link: a change to what its link's earlier beats told
            self.router.update(i, beat.block_hashes, beat.dropped)

    def _silent(self, i: int) -> None:
        """No heartbeat for PING_TIMEOUT_S: busy, stalled, or on its way out. Routed
        around for now; what it serves resumes elsewhere once it has been silent for
        stall_s."""
        if i in self.live:
            log.warning("engine replica %d is not answering", i)
        self.live.discard(i)
        silent = time.monotonic() - self._answered_at[i]
        if silent >= self._stall_s and i in self._where.values():
            log.warning(
                "engine replica %d has not answered for %.0f s; its requests resume "
                "on another replica", i, silent,
            )  # fmt: skip
            self._lost(i)


async def _await(ref: Any) -> Any:
    return await ref


def _merged(first: Any, inbox: asyncio.Queue[Any]) -> list[Any]:
    """`first` and whatever else is queued, consecutive outputs of a choice folded into
    one (a front that falls behind sends fewer, larger deltas); anything else (an end, an
    error, a lost replica) stays where it was."""
    items = [first]
    while not inbox.empty():
        later = inbox.get_nowait()
        last = items[-1]
        if (
            isinstance(later, RequestOutput)
            and isinstance(last, RequestOutput)
            and later.index == last.index
        ):
            items[-1] = last.merge(later)
        else:
            items.append(later)
    return items
