"""LLMEngine: the synchronous core. add_request / abort / step.

    step():  schedule -> run the model -> update counters -> stop checks -> outputs

Everything here runs on one thread; AsyncEngine drives it from a background thread and
LLM (offline) from a plain loop.
"""

from __future__ import annotations

import copy
import logging
import time
import uuid
from collections.abc import Sequence

import torch

from app.config import EngineConfig
from app.engine.block_pool import BlockPool
from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.errors import BadParameter, ContextTooLong
from app.engine.kv_cache import KVCache
from app.engine.kv_manager import KVCacheManager
from app.engine.kv_offload import KVOffload
from app.engine.model_runner import ModelRunner
from app.engine.outputs import (
    EngineListener,
    EngineStats,
    FinishedRequestStats,
    ModelInfo,
    RequestOutput,
)
from app.engine.request import FinishReason, Request, SamplingParams
from app.engine.sampler import Sampler
from app.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from app.kvtier.backends import open_tier
from app.kvtier.fingerprint import ModelFingerprint, weights_digest
from app.model.build import build_model
from app.model.loader import LoadedModel, load_model
from app.model.quantize import int8_weight_bytes

log = logging.getLogger(__name__)


class LLMEngine:
    """Owns the model, the KV cache and the scheduler."""

    def __init__(self, config: EngineConfig | None = None, model: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = model if model is not None else load_model(config.model)
        self.model_name = loaded.name
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = self._resolve_max_model_len(loaded)
        dtype = getattr(torch, config.model.dtype)
        self.model, self.weight_format = build_model(
            loaded, config.model, config.device, self.max_model_len
        )
        if config.model.quantization == "int8":
            self.model_bytes = int8_weight_bytes(self.model)
        else:  # the loaded weights, in the dtype they run in
            self.model_bytes = sum(w.numel() for w in loaded.weights.values()) * dtype.itemsize
        fingerprint = self._fingerprint(loaded) if config.tier.kind != "none" else None
        if model is None:
            # Ours alone: drop the memory-mapped weights before the KV cache takes memory.
            loaded.weights = {}
        self.kv_cache = KVCache(loaded.arch, config.cache, dtype, config.device)
        self.offload = self._open_tier(fingerprint)
        self.kv = KVCacheManager(
            BlockPool(self.kv_cache.num_blocks),
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            self.offload,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(self.model, self.kv_cache, Sampler())
        self.requests: dict[str, Request] = {}
        self.listeners: list[EngineListener] = []
        self._aborted: list[RequestOutput] = []
        self._next_housekeeping = 0.0
        log.info(
            "engine ready: %s, %s weights, max_model_len %d, KV cache %d blocks x %d tokens "
            "(%.0f MiB)",
            self.model_name,
            self.weight_format,
            self.max_model_len,
            self.kv.pool.num_blocks,
            config.cache.block_size,
            self.kv_cache.nbytes / 2**20,
        )

    def _fingerprint(self, loaded: LoadedModel) -> ModelFingerprint:
        """What K/V in the tier must have been computed with to be valid here."""
        m = self.config.model
        return ModelFingerprint(
            weights=weights_digest(loaded.weights),
            arch=repr(loaded.arch),
            dtype=m.dtype,
            quantization=m.quantization,
            block_size=self.config.cache.block_size,
        )

    def _open_tier(self, fingerprint: ModelFingerprint | None) -> KVOffload | None:
        tier_config = self.config.tier
        if fingerprint is None or not self.config.cache.enable_prefix_caching:
            return None
        tier = open_tier(tier_config, fingerprint.hex)
        log.info(
            "KV tier: %s (model fingerprint %s, stores on %s)",
            tier.name,
            fingerprint.hex[:12],
            tier_config.store,
        )
        return KVOffload(self.kv_cache, tier, fingerprint, tier_config)

    def close(self) -> None:
        """Stop the KV tier's threads (queued stores are dropped). Idempotent."""
        if self.offload is not None:
            self.offload.close()
            self.offload = None
            self.kv.offload = None

    def _resolve_max_model_len(self, loaded: LoadedModel) -> int:
        limit = loaded.arch.max_position_embeddings
        if loaded.arch.sliding_window:
            # Attention here is full, not windowed: equal to the model's only within it.
            limit = min(limit, loaded.arch.sliding_window)
        asked = self.config.model.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len {asked} exceeds the model's limit of {limit}")
        return asked or limit

    # -- requests ------------------------------------------------------------------------

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        session_id: str | None = None,
        use_prefix_cache: bool = True,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and tokenize; touches no engine state, so any thread may call it.
        Raises BadParameter (ContextTooLong for a prompt that does not fit) with a
        message fit for the user. A `session_id` keeps the
        request's K/V pinned for that session's next turn (see session_pins);
        `use_prefix_cache=False` computes every prompt token (for comparisons); requests
        with different `cache_salt`s never share prefix-cache blocks."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            token_ids = list(prompt)
            vocab = self.arch.vocab_size
            if any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                for t in token_ids
            ):
                raise BadParameter(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if not token_ids:
            raise BadParameter("the prompt is empty", "prompt")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ContextTooLong(
                f"the prompt is {n} tokens long; this model's context limit is "
                f"{self.max_model_len} tokens, including at least one generated token",
                n,
                self.max_model_len,
            )
        capacity = self.kv.pool.num_blocks * self.kv.block_size
        if n >= capacity:
            raise ContextTooLong(
                f"the prompt is {n} tokens long; the KV cache holds only {capacity} tokens",
                n,
                capacity,
            )
        # One request never outgrows the context or the whole cache: that would preempt
        # itself forever. It stops with finish_reason "length" instead.
        room = min(self.max_model_len, capacity) - n
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(
            request_id or uuid.uuid4().hex,
            token_ids,
            params,
            max_tokens,
            self.eos_token_ids,
            session_id,
            use_prefix_cache,
            cache_salt,
        )
        req.detokenizer = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.skip_special_tokens
        )
        return req

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise BadParameter(f"request id {request.request_id!r} is already in use", "id")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        session_id: str | None = None,
    ) -> Request:
        """Queue a generation. Returns the request (its id is generated when None)."""
        if request_id is not None and request_id in self.requests:
            raise BadParameter(f"request id {request_id!r} is already in use", "id")
        req = self.make_request(prompt, params, request_id, session_id)
        self.add(req)
        return req

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Stop a request and free its blocks now. Its final output (finish_reason
        "abort", or `reason`, with any held-back text) comes out of the next step().
        False if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req, reason)
        self._aborted.append(self._output(req, "", []))
        self._tell_finished(req)
        return True

    def release_session(self, session_id: str) -> bool:
        """Free a session's pinned blocks now (a deleted conversation)."""
        return self.kv.pins.release(session_id, "released")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # -- the step ------------------------------------------------------------------------

    def housekeeping(self) -> None:
        """Periodic chores, at most once a second: let go of expired session pins, stop
        requests over their time limit."""
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + 1.0
        self.kv.pins.expire(self.config.cache.session_ttl_s, now)
        limit = self.config.scheduler.request_timeout_s
        if limit:
            for req in list(self.requests.values()):
                if now - req.timings.arrival > limit:
                    self.abort(req.request_id, FinishReason.TIMEOUT)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return what it produced."""
        self.housekeeping()
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule()
        if sched.is_empty and self.offload is not None:
            self.offload.wait(0.05)  # a request waits for the tier: do not spin meanwhile
        if not sched.is_empty:
            try:
                t0 = time.perf_counter()
                sampled = self.runner.run(sched).sampled
                if self.offload is not None:  # what recomputing costs, for the tier's choice
                    tokens = sum(s.num_tokens for s in sched.scheduled)
                    self.offload.observe_compute(tokens, time.perf_counter() - t0)
            except Exception:
                log.exception("a batch of %d requests failed; retrying them one by one",
                              len(sched.scheduled))  # fmt: skip
                sampled = self._run_one_by_one(sched)
            self.scheduler.update(sched)
            outputs.extend(self._process(sched.scheduled, sampled))
            outputs.extend(self._aborted)  # requests failed this step
            self._aborted = []
        if self.config.debug_checks:
            self.check_integrity()
        return outputs

    def _run_one_by_one(self, sched: SchedulerOutput) -> dict[str, int]:
        """After a failed batch: run each request alone, so that the one that fails ends
        with an error and the others go on."""
        sampled: dict[str, int] = {}
        for s in sched.scheduled:
            try:
                sampled.update(self.runner.run(SchedulerOutput([s])).sampled)
            except Exception:
                log.exception("request %s failed", s.request.request_id)
                self.abort(s.request.request_id, FinishReason.ERROR)
        return sampled

    def _process(
        self, scheduled: list[ScheduledRequest], sampled: dict[str, int]
    ) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for s in scheduled:
            req: Request = s.request
            token = sampled.get(req.request_id)
            if token is None or req.is_finished:
                continue  # a prefill chunk short of the prompt's end, or a failed request
            try:
                outputs.append(self._accept_token(req, token, now))
            except Exception:  # e.g. the detokenizer: this request fails, the others go on
                log.exception("request %s failed after sampling", req.request_id)
                self.abort(req.request_id, FinishReason.ERROR)
        return outputs

    def _accept_token(self, req: Request, token: int, now: float) -> RequestOutput:
        """Append a sampled token, run the stop checks; the request's output."""
        req.append_output_token(token)
        gap = None if req.timings.last_token is None else now - req.timings.last_token
        if req.timings.first_token is None:
            req.timings.first_token = now
        req.timings.last_token = now
        for listener in self.listeners:
            listener.on_tokens(req.request_id, 1, gap)
        detok = req.detokenizer
        assert detok is not None
        reason = None
        text = ""
        if token in req.stop_token_ids:
            reason = FinishReason.STOP  # the stop token's text is never shown
        else:
            text = detok.add_tokens([token])
            if detok.stopped:
                reason = FinishReason.STOP
        if reason is None and (
            req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is not None and not detok.stopped:
            text += detok.flush()
        if reason is not None:
            self.scheduler.finish(req, reason)
            del self.requests[req.request_id]
            self._tell_finished(req)
        return self._output(req, text, [token])

    def _tell_finished(self, req: Request) -> None:
        if self.listeners:
            stats = FinishedRequestStats.of(req)
            for listener in self.listeners:
                listener.on_finished(stats)

    def _output(self, req: Request, text: str, token_ids: list[int]) -> RequestOutput:
        cut_short = req.finish_reason in (
            FinishReason.ABORT,
            FinishReason.TIMEOUT,
            FinishReason.ERROR,
        )
        if req.is_finished and cut_short and req.detokenizer:
            text += "" if req.detokenizer.stopped else req.detokenizer.flush()
        return RequestOutput(
            request_id=req.request_id,
            new_text=text,
            new_token_ids=token_ids,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            prompt_tokens=req.num_prompt_tokens,
            cached_tokens=max(req.num_cached_tokens, 0),
            completion_tokens=req.num_output_tokens,
            timings=copy.copy(req.timings),
            tier_cached_tokens=req.num_tier_cached_tokens,
        )

    # -- introspection -------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(self.model_name, self.max_model_len, self.eos_token_ids, self.tokenizer)

    def stats(self) -> EngineStats:
        pool, s = self.kv.pool, self.scheduler.stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=pool.usage,
            num_free_blocks=pool.num_free_blocks,
            num_blocks=pool.num_blocks,
            num_preemptions=s.num_preemptions,
            prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits,
            pin_hits=s.pin_hits,
            sessions_pinned=len(self.kv.pins),
            pinned_blocks=self.kv.pins.num_blocks,
            session_unpins=dict(self.kv.pins.unpins),
            steps=s.steps,
            tier_hits=s.tier_hits,
            tier=self.offload.stats() if self.offload is not None else None,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError if blocks, tables and requests disagree."""
        self.kv.check_integrity()
        sched = self.scheduler
        ids = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
        assert ids == set(self.requests), "scheduler and engine disagree on live requests"
        assert len(sched.running) <= self.config.scheduler.max_num_seqs
