"""LLMEngine: the synchronous core. add_request / abort / step.

    step():  schedule -> run the model -> update counters and token-level stops (the
             scheduler) -> text, stop strings and outputs (the output stage)

Everything here runs on one thread; AsyncEngine drives it from a background thread and
LLM (offline) from a plain loop.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from app.config import EngineConfig
from app.engine.admission import RequestMaker
from app.engine.block_pool import BlockPool
from app.engine.engine_request import EngineRequest
from app.engine.errors import BadParameter
from app.engine.kv_cache import KVCache
from app.engine.kv_manager import KVCacheManager
from app.engine.kv_offload import model_fingerprint, open_offload
from app.engine.logprobs import Logprob
from app.engine.model_runner import ModelRunner, ModelRunnerOutput
from app.engine.outputs import (
    ITL_OVER,
    EngineListener,
    EngineStats,
    FinishedRequestStats,
    ModelInfo,
    RequestOutput,
)
from app.engine.request import FinishReason, Request
from app.engine.sampler import Sampler
from app.engine.scheduler import Accepted, ScheduledRequest, Scheduler, SchedulerOutput
from app.engine.structured import GrammarCompiler
from app.engine.threads import ThreadPolicy, read_ceiling
from app.model.build import build_model
from app.model.device import resolve_device
from app.model.loader import LoadedModel, load_model

log = logging.getLogger(__name__)


class LLMEngine:
    """Owns the model, the KV cache and the scheduler."""

    def __init__(self, config: EngineConfig | None = None, model: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        self.device = resolve_device(config.device)  # once: nothing per step asks again
        # CPU threads: pinned by config.num_threads (--threads), else chosen step by step
        # from what the machine gives (app.engine.threads), up to what we may use.
        self.threads: ThreadPolicy | None = None
        if self.device.type == "cpu":
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
            else:
                ceiling = read_ceiling(at_most=config.max_threads)
                self.threads = ThreadPolicy(ceiling)
                torch.set_num_threads(ceiling.threads)
                log.info("CPU threads: up to %d (%s), fewer while CPUs are contended",
                         ceiling.threads, ceiling.why)  # fmt: skip
        # A thread's OpenMP thread count is its own: the AsyncEngine's thread sets this one,
        # and step() sets it again whenever the policy changes it.
        self.num_threads = torch.get_num_threads()
        loaded = model if model is not None else load_model(config.model)
        self.model_name = loaded.name
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = self._resolve_max_model_len(loaded)
        built = build_model(loaded, config.model, str(self.device), self.max_model_len)
        self.model, self.weight_format = built.model, built.format.describe()
        self.model_bytes = built.weight_bytes
        dtype = built.format.torch_dtype  # K/V follow the activations
        fingerprint = None
        if config.tier.kind != "none" and config.cache.enable_prefix_caching:
            fingerprint = model_fingerprint(loaded, built.format, config.cache.block_size)
        if model is None:
            # Ours alone: drop the memory-mapped weights before the KV cache takes memory.
            loaded.weights = {}
        self.kv_cache = KVCache(loaded.arch, config.cache, dtype, self.device)
        self.offload = open_offload(config.tier, self.kv_cache, fingerprint)
        release = None
        if config.cache.release_out_of_window and self.kv_cache.can_release:
            release = self.kv_cache.release_local
            self.kv_cache.poison_released = config.debug_checks
        cache = self.kv_cache  # a windowed block costs less only where release gives back
        pool = BlockPool(cache.num_blocks, cache.bytes_per_block,
                         cache.windowed_bytes_per_block, cache.budget_blocks,
                         drop=cache.release_blocks)  # fmt: skip
        self.kv = KVCacheManager(
            pool,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            self.offload,
            window=self.kv_cache.local_window,
            release=release,
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            max_model_len=self.max_model_len,
            vocab_size=loaded.arch.vocab_size,
        )
        arch = loaded.arch
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            Sampler(),
            max_num_seqs=config.scheduler.max_num_seqs,
            cuda_graphs=config.cuda_graphs,
            attention=self.model.ops.attention(
                config.cache.block_size, arch.num_heads // arch.num_kv_heads, dtype
            ),
        )
        self.grammars = GrammarCompiler(self.tokenizer, loaded.arch.vocab_size, self.eos_token_ids)
        self.maker = RequestMaker(
            self.tokenizer,
            loaded.arch.vocab_size,
            self.max_model_len,
            self.kv.pool.num_blocks * self.kv.block_size,
            config.scheduler.max_num_seqs,
            self.eos_token_ids,
            self.grammars,
        )
        self.requests: dict[str, Request] = {}  # every live choice, by its own id
        self._groups: dict[str, list[Request]] = {}  # the caller's id -> its choices
        self.listeners: list[EngineListener] = []
        self._itl_gaps = 0  # gaps held against the policy's target, and those over ITL_OVER x
        self._itl_over = [0] * len(ITL_OVER)
        self._aborted: list[RequestOutput] = []
        self._next_housekeeping = 0.0
        more = self.kv_cache.num_blocks - 1 - self.kv.pool.num_blocks
        log.info(
            "engine ready on %s: %s, %s, max_model_len %d, KV cache %d blocks x %d tokens "
            "(%.0f MiB)%s",
            self.device,
            self.model_name,
            self.weight_format,
            self.max_model_len,
            self.kv.pool.num_blocks,
            config.cache.block_size,
            self.kv_cache.nbytes / 2**20,
            f", and up to {more} more in the memory the local layers' window gives back"
            if more > 0
            else "",
        )

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

    def make_request(self, asked: EngineRequest) -> Request:
        """Validate and tokenize (app.engine.admission); touches no engine state, so any
        thread may call it. Raises BadParameter (ContextTooLong for a prompt that does
        not fit) with a message fit for the user."""
        return self.maker.make(asked)

    def add(self, request: Request) -> None:
        """Queue a request made by make_request (and its choices)."""
        group = [request, *request.forks]
        if request.request_id in self._groups or any(r.request_id in self.requests for r in group):
            raise BadParameter(f"request id {request.request_id!r} is already in use", "id")
        self._groups[request.request_id] = group
        for r in group:
            self.requests[r.request_id] = r
        self.scheduler.add(request)

    def add_request(self, asked: EngineRequest) -> Request:
        """Queue a generation: make_request, then add. Returns the engine's request."""
        if asked.request_id in self._groups:
            raise BadParameter(f"request id {asked.request_id!r} is already in use", "id")
        req = self.make_request(asked)
        self.add(req)
        return req

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Stop a request (every choice still running) and free its blocks now. Its final
        outputs (finish_reason "abort", or `reason`, with any held-back text) come out of
        the next step(). False if unknown."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for req in list(group):
            self._stop(req, reason)
        return True

    def _stop(self, req: Request, reason: FinishReason) -> None:
        """End one choice early (and the choices it was to fork, which hold nothing)."""
        for child in req.forks:
            self._stop(child, reason)
        req.forks = []
        if req.is_finished:
            return
        self.scheduler.finish(req, reason)
        self._aborted.append(self._output(req, "", []))
        self._finished(req)

    def _finished(self, req: Request) -> None:
        del self.requests[req.request_id]
        group = self._groups[req.group_id]
        group.remove(req)
        if not group:
            del self._groups[req.group_id]
        self._tell_finished(req)

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
                    self.abort(req.group_id, FinishReason.TIMEOUT)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return what it produced."""
        self.housekeeping()
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule()
        if sched.is_empty and self.offload is not None:
            self.offload.wait(0.05)  # a request waits for the tier: do not spin meanwhile
        if not sched.is_empty:
            self._set_threads()
            try:
                started = time.perf_counter()
                ran = self.runner.run(sched)
                elapsed = time.perf_counter() - started
                self.scheduler.observe_step(sched, elapsed)
                if self.threads is not None and self.scheduler.last_step is not None:
                    self.threads.observe(self.scheduler.last_step.predicted_s, elapsed)
                if self.offload is not None:  # what recomputing costs, for the tier's choice
                    tokens = sum(s.num_tokens for s in sched.scheduled)
                    self.offload.observe_compute(tokens, elapsed)
            except Exception:
                log.exception("a batch of %d requests failed; retrying them one by one",
                              len(sched.scheduled))  # fmt: skip
                ran = self._run_one_by_one(sched)
            self.scheduler.update(sched)
            outputs.extend(self._process(sched.scheduled, ran))
            outputs.extend(self._aborted)  # requests failed this step
            self._aborted = []
        if self.config.debug_checks:
            self.check_integrity()
        return outputs

    def _set_threads(self) -> None:
        """The policy's count for this step, on this (the engine's) thread: torch's pool,
        and so Parley's kernels, the sampler and every op of the step, follow it."""
        if self.threads is not None:
            wanted = self.threads.threads()
            if wanted != torch.get_num_threads():
                torch.set_num_threads(wanted)
                self.num_threads = wanted

    def _run_one_by_one(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """After a failed batch: run each request alone, so that the one that fails ends
        with an error and the others go on. (Block copies are made again with each: a
        copy's source is never written before its copies are made, so that is harmless.)"""
        ran = ModelRunnerOutput({})
        for s in sched.scheduled:
            try:
                one = self.runner.run(SchedulerOutput([s], block_copies=sched.block_copies))
            except Exception:
                log.exception("request %s failed", s.request.request_id)
                self._stop(s.request, FinishReason.ERROR)
                continue
            ran.sampled.update(one.sampled)
            ran.logprobs.update(one.logprobs)
            ran.prompt_logprobs.update(one.prompt_logprobs)
        return ran

    def _process(
        self, scheduled: list[ScheduledRequest], ran: ModelRunnerOutput
    ) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for s in scheduled:
            if s.request.is_finished:
                continue  # failed during the step
            scored = ran.prompt_logprobs.get(s.request.request_id)
            if scored:
                s.request.prompt_logprobs.extend(scored)
            if s.samples and s.request.max_tokens == 0:  # scored, nothing to generate
                outputs.append(self._end(s.request, FinishReason.LENGTH))
                continue
            for req in (s.request, *s.forks):
                token = ran.sampled.get(req.request_id)
                if token is None or req.is_finished:
                    continue  # a prefill chunk short of the prompt's end, or a failure
                try:
                    accepted = self.scheduler.accept(req, token)  # token-level stops
                    out = self._output_stage(req, accepted, now, ran.logprobs.get(req.request_id))
                    if out is not None:
                        outputs.append(out)
                except Exception:  # e.g. the detokenizer: this one fails, the others go on
                    log.exception("request %s failed after sampling", req.request_id)
                    self._stop(req, FinishReason.ERROR)
        return outputs

    def _end(self, req: Request, reason: FinishReason) -> RequestOutput:
        self.scheduler.finish(req, reason)
        self._finished(req)
        return self._output(req, "", [])

    def _output_stage(
        self, req: Request, accepted: Accepted, now: float, logprob: Logprob | None = None
    ) -> RequestOutput | None:
        """What follows the scheduler's token-level checks: the token's logprob, timings
        and listeners, then its text (detokenized, held back or stopped by a stop string,
        flushed at the end); finishes the request when a stop was hit. A replayed token
        goes out with no output (the caller has it and its text), unless the request
        ends on it."""
        token, reason = accepted.token, accepted.reason
        if not accepted.replayed:
            if logprob is not None:
                req.logprobs.append(logprob)
            gap = None if req.timings.last_token is None else now - req.timings.last_token
            if gap is not None:
                self._count_gap(gap)
            if req.timings.first_token is None:
                req.timings.first_token = now
            req.timings.last_token = now
            for listener in self.listeners:
                listener.on_tokens(req.request_id, 1, gap)
        detok = req.detokenizer
        assert detok is not None
        text = ""
        if token not in req.stop_token_ids:  # a stop token's text is never shown
            text = detok.add_tokens([token])
            if detok.stopped:
                reason = FinishReason.STOP  # a stop string, before any length limit
        if reason is not None and not detok.stopped:
            text += detok.flush()
        if reason is not None:
            self.scheduler.finish(req, reason)
            self._finished(req)
        if accepted.replayed:
            return None if reason is None else self._output(req, "", [])
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
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = req.logprobs[len(req.logprobs) - len(token_ids) :]
        prompt_logprobs = None
        first = req.num_output_tokens == len(token_ids) and (token_ids or req.max_tokens == 0)
        if req.params.prompt_logprobs is not None and first:
            prompt_logprobs = list(req.prompt_logprobs)
        return RequestOutput(
            request_id=req.group_id,
            new_text=text,
            new_token_ids=token_ids,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            prompt_tokens=req.num_prompt_tokens,
            cached_tokens=max(req.num_cached_tokens, 0),
            completion_tokens=req.num_output_tokens,
            timings=copy.copy(req.timings),
            index=req.index,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            tier_cached_tokens=req.num_tier_cached_tokens,
        )

    def _count_gap(self, gap: float) -> None:
        """An inter-token gap as the engine sees it (before any delivery), against the
        target in force once the step that ended it was measured."""
        target = self.scheduler.last_step.itl_target_s
        if not target:
            return
        self._itl_gaps += 1
        for i, times in enumerate(ITL_OVER):
            if gap > times * target:
                self._itl_over[i] += 1

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
            step=self.scheduler.last_step,
            tier_hits=s.tier_hits,
            tier=self.offload.stats() if self.offload is not None else None,
            kv_resident_bytes=pool.resident,
            itl_gaps=self._itl_gaps,
            itl_gaps_over=tuple(self._itl_over),
            cpu_threads=self.num_threads if self.device.type == "cpu" else 0,
            thread_changes=self.threads.stats.changes if self.threads is not None else 0,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError if blocks, tables and requests disagree."""
        self.kv.check_integrity()
        sched = self.scheduler
        queued = [*sched.running, *sched.waiting]
        ids = {r.request_id for r in queued} | {f.request_id for r in queued for f in r.forks}
        assert ids == set(self.requests), "scheduler and engine disagree on live requests"
        grouped = {r.request_id for group in self._groups.values() for r in group}
        assert grouped == ids, "request groups and live requests disagree"
        assert len(sched.running) <= self.config.scheduler.max_num_seqs
