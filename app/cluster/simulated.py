"""A simulated replica: the replica's surface (Ray calls, the link) without a model, for
measuring the front.

Every `1 / steps_per_s` seconds one "step" gives each running request one token (a
fixed token id and its text) and queues the step's outputs for the front exactly as a
real replica does (replica.py), so the front, Ray and the server do all of their usual
work while the replicas cost next to nothing. A request ends after its max_tokens
(DEFAULT_TOKENS without one); an abort ends it at the next step. Its tokenizer is the
configured model's (the front builds chat prompts with it); its weights stay on disk.

(`bench/cluster_load.py --root OLD_CHECKOUT` compares fronts: each checkout runs its own.)
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from app.cluster.link import Beat, LinkAddress, ReplicaLinks
from app.cluster.replica import Outbox, Relayed, ReplicaBeat, link_host
from app.config import EngineConfig
from app.engine.engine_request import EngineRequest
from app.engine.outputs import EngineStats, FinishedRequestStats, ModelInfo, RequestOutput
from app.engine.request import FinishReason, SamplingParams, Timings
from app.model.loader import LoadedModel, load_model

DEFAULT_TOKENS = 64


@dataclass
class _SimRequest:
    request_id: str
    session_id: str | None
    num_prompt: int
    max_tokens: int
    deliver: Callable[[Relayed], None]
    done: int = 0
    aborted: bool = False
    timings: Timings = field(default_factory=Timings)


class SimulatedReplica:
    """A replica that emits one token per request every 1 / steps_per_s seconds."""

    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, steps_per_s: float = 50.0
    ) -> None:
        if steps_per_s <= 0:
            raise ValueError(f"steps_per_s must be > 0, got {steps_per_s}")
        loaded = loaded or load_model(config.model)
        tokenizer = loaded.tokenizer
        max_len = config.model.max_model_len or loaded.arch.max_position_embeddings
        self._info = ModelInfo(loaded.name, max_len, loaded.eos_token_ids, tokenizer)
        loaded.weights = {}  # never computed with
        self._token = tokenizer.encode(" word", add_special_tokens=False)[0]
        self._text = tokenizer.decode([self._token])
        self._interval = 1.0 / steps_per_s
        self._running: dict[str, _SimRequest] = {}
        self._outboxes: dict[str, Outbox] = {}
        self._steps = 0
        self._ticker: asyncio.Task[None] | None = None
        self._links = ReplicaLinks(self)

    def info(self) -> ModelInfo:
        return self._info

    def pid(self) -> int:
        return os.getpid()

    def healthy(self) -> bool:
        return True

    async def open_link(self, front: str, front_ip: str, beat: Beat | None = None) -> LinkAddress:
        return await self._links.open(front, link_host(front_ip), beat)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running), num_waiting=0, kv_usage=0.0, num_free_blocks=0,
            num_blocks=0, num_preemptions=0, prefix_queries=0, prefix_hits=0, pin_hits=0,
            sessions_pinned=0, pinned_blocks=0, session_unpins={}, steps=self._steps,
        )  # fmt: skip

    def heartbeat(self, max_hashes: int, published: set[bytes] | None = None) -> ReplicaBeat:
        return ReplicaBeat.of(self.stats(), [], published)

    def submit(self, front: str, asked: EngineRequest) -> None:
        box = self._outboxes.get(front)
        if box is None:
            box = self._outboxes[front] = Outbox()
        self._add(asked.request_id, asked.session_id, len(asked.prompt), asked.params, box.put)

    async def stream(self, front: str) -> AsyncIterator[list[Relayed]]:
        box = self._outboxes.get(front)
        if box is None:
            box = self._outboxes[front] = Outbox()
        while True:
            yield await box.take()

    def abort(self, request_id: str) -> None:
        request = self._running.get(request_id)
        if request is not None:
            request.aborted = True

    def release_session(self, session_id: str) -> None:
        pass

    async def stop(self) -> None:
        await self._links.close()
        if self._ticker is not None:
            self._ticker.cancel()

    # -- inside ------------------------------------------------------------------------------

    def _add(
        self,
        request_id: str,
        session_id: str | None,
        num_prompt: int,
        params: SamplingParams,
        deliver: Callable[[Relayed], None],
    ) -> None:
        max_tokens = params.max_tokens or DEFAULT_TOKENS
        self._running[request_id] = _SimRequest(
            request_id, session_id, num_prompt, max_tokens, deliver
        )
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at = max(next_at + self._interval, loop.time())
            await asyncio.sleep(next_at - loop.time())
            self._step()

    def _step(self) -> None:
        self._steps += 1
        now = time.monotonic()
        for request_id, r in list(self._running.items()):
            r.timings.first_scheduled = r.timings.first_scheduled or now
            r.timings.first_token = r.timings.first_token or now
            r.timings.last_token = now
            reason = FinishReason.ABORT if r.aborted else None
            if not r.aborted:
                r.done += 1
                if r.done >= r.max_tokens:
                    reason = FinishReason.LENGTH
            out = RequestOutput(
                request_id=request_id,
                new_text="" if r.aborted else self._text,
                new_token_ids=[] if r.aborted else [self._token],
                finished=reason is not None,
                finish_reason=reason,
                prompt_tokens=r.num_prompt,
                cached_tokens=0,
                completion_tokens=r.done,
                timings=r.timings,
            )
            r.deliver((request_id, out))
            if reason is not None:
                del self._running[request_id]
                r.timings.finished = now
                stats = FinishedRequestStats(
                    request_id, r.session_id, reason, r.num_prompt, 0, r.done, 0,
                    copy.copy(r.timings),
                )  # fmt: skip
                r.deliver((request_id, stats))
