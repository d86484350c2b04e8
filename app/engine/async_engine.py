"""AsyncEngine: one background thread drives LLMEngine.step(); asyncio code talks to it
through generate() (an async iterator of outputs) and abort().

This is the one seam between the web and the engine. The engine's state is touched only
by its thread: adds and aborts travel through a queue and are applied between steps, so
an abort frees the request's blocks before the next step runs. Outputs travel back with
one `call_soon_threadsafe` per step. A consumer that reads slower than tokens come gets
them merged into one output per choice rather than a growing backlog of small ones.

One thread computes. PyTorch's CPU kernels run on OpenMP, and libgomp keeps a pool of
worker threads for every thread that ever ran a parallel region, for as long as that
thread lives. With more pool threads than cores, libgomp stops spinning between parallel
regions and puts its workers to sleep: each of the ~300 parallel regions of a decode step
then pays a wake-up. A model built on the event loop's thread (or on a thread pool's,
which lives on) left such a pool behind, and one conversation over /ws decoded at ~60
tokens/s where the same engine alone made ~115 (2 cores, int4). So `AsyncEngine.build`
makes the engine on a thread of its own that ends when the model is built, and the engine
thread is the only one left computing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from app.config import INLINE_TEXT_CHARS, EngineConfig
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.errors import BadParameter, EngineDead, Overloaded
from app.engine.outputs import EngineListener, EngineStats, ModelInfo, RequestOutput
from app.engine.request import FinishReason, Request
from app.model.loader import LoadedModel

log = logging.getLogger(__name__)

# Prompts larger than this are validated and tokenized on a worker thread (text: see
# INLINE_TEXT_CHARS); token ids only need checking, quicker inline up to many more.
INLINE_PROMPT_IDS = 32768


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    # With a stream interval: each choice's output not handed out yet, and the choices
    # whose first output went (touched on the engine's thread only).
    held: dict[int, RequestOutput] = field(default_factory=dict)
    started: set[int] = field(default_factory=set)

    def gather(self, out: RequestOutput, interval: int) -> RequestOutput | None:
        """`out` with what its choice held back before it, once due (the choice's first
        output, its last, or `interval` tokens); None while it is held back."""
        held = self.held.pop(out.index, None)
        if held is not None:
            out = held.merge(out)
        if out.finished or out.index not in self.started or len(out.new_token_ids) >= interval:
            self.started.add(out.index)
            return out
        self.held[out.index] = out
        return None


# What the event loop's side asks of the engine's thread, applied between steps.
class _Add(NamedTuple):
    request: Request  # made (validated, tokenized) on the caller's side


class _Abort(NamedTuple):
    request_id: str  # its blocks are freed before the next step


class _Release(NamedTuple):
    session_id: str  # its pinned K/V let go of


_Message = _Add | _Abort | _Release


class AsyncEngine:
    """Thread-backed asynchronous front of an LLMEngine."""

    def __init__(self, engine: LLMEngine, idle_check_s: float = 0.0) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        # Requests between generate() and their queueing (tokenizing a long prompt,
        # compiling a grammar): True once aborted meanwhile, so the abort follows the add.
        self._preparing: dict[str, bool] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._idle_check_s = idle_check_s  # > 0: check_integrity() when idle (debug)
        self.error: BaseException | None = None  # set if the loop itself died
        # Admission control: a batch's worth running plus a bounded queue; beyond that a
        # new request is refused at once instead of waiting without limit.
        sched = engine.config.scheduler
        self.capacity = sched.max_num_seqs + sched.max_waiting
        self.num_in_flight = 0  # generate() calls under way (touched on the event loop)
        self._stats = engine.stats()  # a snapshot the engine thread refreshes
        self._malloc_trim = None
        self._next_trim = 0.0
        self._info = engine.info
        self.stream_interval = engine.config.stream_interval

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    def build(cls, config: EngineConfig, model: LoadedModel | None = None) -> AsyncEngine:
        """Load and build the engine on a short-lived thread of its own (see the module's
        docstring: no OpenMP pool is left behind on the caller's thread)."""
        # The executor's one worker thread ends when the `with` block shuts it down.
        with ThreadPoolExecutor(1, thread_name_prefix="parley-engine-build") as builder:
            return cls(builder.submit(LLMEngine, config, model).result())

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="parley-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort everything, stop the loop and wait for its thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self.engine.close()  # the KV tier's threads

    @property
    def info(self) -> ModelInfo:
        return self._info

    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- requests ------------------------------------------------------------------------

    async def generate(self, asked: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes (each of its params.n choices;
        outputs carry their choice's `index`). Leaving the loop early (break,
        cancellation, an exception in the consumer) aborts the request. One engine
        ignores `routing_key`: every request is at home here.

        Raises BadParameter / ContextTooLong for invalid input (before anything is
        queued), Overloaded when the queue is full and EngineDead when the loop is not
        running.
        """
        if not self.healthy():
            raise EngineDead("the engine is not running")
        seats = asked.params.n  # each choice runs as a sequence
        if self.num_in_flight + seats > self.capacity:
            raise Overloaded(
                f"the server is busy: {self.num_in_flight} requests in flight "
                f"(at most {self.capacity}); retry shortly"
            )
        self.num_in_flight += seats  # from here on: slots are held, even while tokenizing
        finished = False
        unfinished = seats
        stream: _Stream | None = None
        with self._streams_lock:  # abort() reads it from any thread
            preparing = asked.request_id not in self._preparing
            if preparing:
                self._preparing[asked.request_id] = False
        try:
            req = await self._make_request(asked)
            stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
            with self._streams_lock:
                aborted = preparing and self._preparing.pop(req.request_id, False)
                preparing = False
                if req.request_id in self._streams:
                    stream = None
                    raise BadParameter(f"request id {req.request_id!r} is already in use", "id")
                self._streams[req.request_id] = stream
                self._inbox.put(_Add(req))
                if aborted:  # while it was being prepared: it ends at its first step
                    self._inbox.put(_Abort(req.request_id))
            self._wake.set()
            while not finished:
                for item in _merged(await stream.queue.get(), stream.queue):
                    if isinstance(item, BaseException):
                        raise item
                    unfinished -= item.finished
                    finished = unfinished == 0
                    yield item
        finally:
            if preparing:
                with self._streams_lock:
                    self._preparing.pop(asked.request_id, None)
            self.num_in_flight -= seats
            if stream is not None:
                with self._streams_lock:
                    self._streams.pop(req.request_id, None)
                if not finished:
                    self.abort(req.request_id)

    async def _make_request(self, asked: EngineRequest) -> Request:
        prompt, params = asked.prompt, asked.params
        large = len(prompt) > (INLINE_TEXT_CHARS if isinstance(prompt, str) else INLINE_PROMPT_IDS)
        if params.response_format is not None:
            # Compiled on the grammar worker, off this loop, under its caps (structured.py);
            # its matcher (ms for a large grammar) is made off the loop too.
            await self.engine.grammars.prepare(params.response_format)
            large = True
        if large:
            return await asyncio.to_thread(self.engine.make_request, asked)
        return self.engine.make_request(asked)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed before the next step. Thread-safe."""
        with self._streams_lock:
            if request_id in self._preparing:  # not queued yet: the add puts the abort
                self._preparing[request_id] = True
                return
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def add_listener(self, listener: EngineListener) -> None:
        """Tell `listener` (an EngineListener) about tokens and finished requests. Call
        before start(): the list is read on the engine's thread."""
        self.engine.listeners.append(listener)

    def release_session(self, session_id: str) -> None:
        """Free a session's pinned blocks before the next step. Thread-safe."""
        self._inbox.put(_Release(session_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (safe from any thread)."""
        return self._stats

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        if self.engine.device.type == "cpu":
            torch.set_num_threads(self.engine.num_threads)  # OpenMP's count is per thread
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self.engine.housekeeping()
                    self._stats = self.engine.stats()
                    self._trim_heap()
                    if self._idle_check_s:
                        self.engine.check_integrity()
                    # Wake at least once a minute for housekeeping (pins expire).
                    self._wake.wait(self._idle_check_s or 60.0)
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # one bad step must not kill the server
                    log.exception("engine step failed; failing the requests in flight")
                    outputs = self._fail_all(exc)
                self._stats = self.engine.stats()
                self._deliver(outputs)
        except BaseException as exc:  # the loop itself is broken: report, do not hide
            log.exception("engine loop died")
            self.error = exc
            self._fail_streams(EngineDead(f"engine loop died: {exc!r}"))
        finally:
            try:
                self._drain_inbox()  # releases and aborts sent before stop() still apply
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
            except Exception:
                log.exception("cleaning up after the engine loop failed")
            self._fail_streams(EngineDead("the engine stopped"))

    def _trim_heap(self) -> None:
        """When idle, hand freed heap memory back to the OS (glibc keeps it otherwise:
        steps allocate tensors of ever-different sizes, and a long run's resident memory
        would creep up). At most every 10 seconds; a no-op without glibc."""
        now = time.monotonic()
        if now < self._next_trim:
            return
        self._next_trim = now + 10.0
        if self._malloc_trim is None:
            try:
                self._malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                self._malloc_trim = False
        if self._malloc_trim:
            self._malloc_trim(0)

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            match message:
                case _Add(request):
                    try:
                        self.engine.add(request)
                    except BadParameter as exc:
                        self._deliver_error(request.request_id, exc)
                case _Abort(request_id):
                    self.engine.abort(request_id)
                case _Release(session_id):
                    self.engine.release_session(session_id)

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id, FinishReason.ERROR)
        return self.engine.step() if self.engine.has_unfinished_requests() else []

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        interval = self.stream_interval
        with self._streams_lock:
            for o in outputs:
                stream = self._streams.get(o.request_id)
                if stream is None:
                    continue
                due = stream.gather(o, interval) if interval > 1 else o
                if due is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, due))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop closed: nobody listens
                loop.call_soon_threadsafe(_put_all, items)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)

    def _fail_streams(self, exc: BaseException) -> None:
        with self._streams_lock:
            ids = list(self._streams)
        for request_id in ids:
            self._deliver_error(request_id, exc)


def settle_heap() -> None:
    """Once a process that serves has loaded its model: move every object alive now out of
    the garbage collector's sight (gc.freeze). The model, tokenizer and libraries are
    hundreds of thousands of objects that live as long as the process, and every full
    collection traversed them: ~5% of a decode step's CPU time on one thread. For a
    serving process alone (the server, a replica), never in library code, where a frozen
    cycle of objects would never be freed."""
    gc.collect()
    gc.freeze()


def _merged(
    first: RequestOutput | BaseException, queue: asyncio.Queue[RequestOutput | BaseException]
) -> list[RequestOutput | BaseException]:
    """`first` and whatever else is queued, each choice's outputs folded into one (in the
    order the choices first appear); an error comes last and ends the list."""
    if isinstance(first, BaseException):
        return [first]
    by_index: dict[int, RequestOutput] = {first.index: first}
    while not queue.empty():
        later = queue.get_nowait()
        if isinstance(later, BaseException):
            return [*by_index.values(), later]
        earlier = by_index.get(later.index)
        by_index[later.index] = later if earlier is None else earlier.merge(later)
    return list(by_index.values())


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.queue.put_nowait(output)
