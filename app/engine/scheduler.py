"""Continuous batching under a token budget.

Each step the scheduler hands out up to `max_num_batched_tokens` tokens:

1. decodes first: every running request with one token left gets it (steady inter-token
   latency for the conversations already talking);
2. then prompts, those part-way through (chunked prefill) and new requests from the
   waiting queue alike, in the order the policy picks (earliest deadline first, or those
   under way and then the waiting in arrival order); a new one is admitted with its first
   chunk while the budget, `max_num_seqs` and free blocks allow. It first takes whatever
   prefix of it the prefix cache holds (or its session's pin, or the KV tier below the
   pool: while the tier's blocks are on their way it waits, and nobody overtakes it).

While anything decodes, the policy sizes each prefill chunk (app.engine.policy): every
decoder waits for the whole step, so a long prompt must arrive in bites small enough to
keep their inter-token latency near its target. When blocks run out, idle sessions lose their pins
first (least recently active first), then the newest running request is preempted:
its blocks are freed (their hashes stay, so its recompute is mostly cache hits) and it goes
back to the front of the waiting queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from app.config import SchedulerConfig
from app.engine.cost_model import StepShape
from app.engine.kv_manager import ComputedPrefix, KVCacheManager
from app.engine.outputs import StepReport
from app.engine.policy import BatchPolicy, make_policy
from app.engine.request import FinishReason, Request, RequestStatus

# A request that wants its prompt's logprobs gets logits for every prompt token: chunks of
# at most this many tokens keep those logits (tokens x vocabulary floats) to ~50 MB.
PROMPT_LOGPROBS_CHUNK = 256


@dataclass(frozen=True)
class Accepted:
    """A token appended to a request, and the token-level stop it hit (or None)."""

    token: int
    replayed: bool  # the caller has it already: no output for it
    reason: FinishReason | None


@dataclass(frozen=True)
class ScheduledRequest:
    """A request and the tokens it computes this step: counts taken when the step was
    scheduled, so they stay true after update() has moved the request on."""

    request: Request
    start: int  # position of the first token computed this step
    num_tokens: int
    samples: bool  # the step reaches the request's last known token: it samples
    block_ids: list[int]
    # Choices of the same prompt that sample from this step's logits too and then take
    # the request's blocks by reference (its prompt's last chunk, n > 1).
    forks: tuple[Request, ...] = ()

    @property
    def is_decode(self) -> bool:
        """One token that samples, with K/V before it: attended through the block table
        in the batched decode call. A one-token prefill chunk that does not reach the
        end of the prompt is not a decode (it must not sample)."""
        return self.num_tokens == 1 and self.samples and self.start > 0


@dataclass
class SchedulerOutput:
    """One step's work: decodes first, then prefill chunks. Built by schedule(), read by
    the runner and by update(); nobody changes it afterwards."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    shape: StepShape = field(default_factory=StepShape)  # what the cost model sees
    # (source, destination) block ids to copy before the forward pass: copy on write.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Counters since start (for metrics and benchmarks)."""

    num_preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # ... found there
    pin_hits: int = 0  # ... found in their session's pin
    tier_hits: int = 0  # ... loaded from the KV tier
    steps: int = 0


class Scheduler:
    """Decides, each step, which requests compute how many tokens."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVCacheManager,
        policy: BatchPolicy | None = None,
        *,
        max_model_len: int | None = None,
        vocab_size: int = 0,
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.max_model_len = max_model_len  # None: only max_tokens bounds a request
        self.vocab_size = vocab_size  # what a grammar's end is checked against
        self.policy = policy or make_policy(cfg)
        self.last_step = StepReport()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: newest last
        self.stats = SchedulerStats()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: set[str] = set()
        budget = self.cfg.max_num_batched_tokens

        # 1. Decodes, oldest first.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        shape = StepShape()
        for req in decodes:
            if req.status is RequestStatus.RUNNING and self._grant(req, 1, out, scheduled):
                budget -= 1
                shape = shape.plus_decode(req.num_tokens)
        # 2. Prompts, those under way and new requests alike, in the policy's order: a
        # waiting request takes its first chunk by being admitted.
        prefill_budget = budget
        seats = len(self.running) + sum(len(r.forks) for r in self.running)
        admitting = True
        for req in self.policy.prefill_order(prefills, self.waiting):
            if prefill_budget <= 0:
                break
            if req.status is RequestStatus.RUNNING:
                start = req.num_computed_tokens
                n = self._chunk(shape, req, start, prefill_budget)
                if n and self._grant(req, n, out, scheduled):
                    prefill_budget -= n
                    shape = shape.plus_prefill(n, start)
            elif admitting and not out.preempted:  # no admissions once memory ran short
                start, n = self._admit(req, shape, prefill_budget, seats, out, scheduled)
                if not n:
                    admitting = False  # nobody overtakes the request the policy chose
                    continue
                seats += 1 + len(req.forks)
                prefill_budget -= n
                shape = shape.plus_prefill(n, start)
        out.shape = shape
        out.block_copies = self.kv.take_copies()
        self.stats.steps += 1
        return out

    def _admit(
        self,
        req: Request,
        shape: StepShape,
        budget: int,
        seats: int,
        out: SchedulerOutput,
        scheduled: set[str],
    ) -> tuple[int, int]:
        """Admit a waiting request with its first chunk: (its start, the chunk's tokens),
        or (0, 0) when it cannot come in this step (no seat, no blocks, K/V on its way
        from the tier, or no room in the step)."""
        if seats + 1 + len(req.forks) > self.cfg.max_num_seqs:
            return 0, 0
        computed = self.kv.get_computed(req)
        if computed.pending:
            return 0, 0  # its K/V is on its way from the tier: admitted once it has arrived
        num_hit = computed.num_tokens
        n = self._chunk(shape, req, num_hit, budget)
        if not n or not self._allocate(req, n, computed):
            return 0, 0
        self.waiting.remove(req)
        if req.session_id is not None:
            self.kv.pins.consume(req.session_id)
        if req.num_cached_tokens < 0:
            # First admission only: a preempted request's re-admission finds its own
            # freed blocks, which is not a prefix-cache hit (and would count twice).
            req.num_cached_tokens = num_hit
            req.num_tier_cached_tokens = computed.num_tier_tokens
            self.stats.prefix_queries += req.num_tokens
            if computed.from_pin:
                self.stats.pin_hits += num_hit
            else:
                self.stats.prefix_hits += num_hit - computed.num_tier_tokens
                self.stats.tier_hits += computed.num_tier_tokens
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit
        if req.timings.first_scheduled is None:
            req.timings.first_scheduled = time.monotonic()
        self.running.append(req)
        self._emit(req, n, out, scheduled)
        return num_hit, n

    def _chunk(self, shape: StepShape, req: Request, start: int, budget: int) -> int:
        """Tokens to prefill this step of `req`'s prompt, computed up to `start`, in a
        step that already holds `shape`: the policy's call."""
        n = self.policy.prefill_tokens(shape, start, req.num_tokens - start, budget)
        if req.params.prompt_logprobs is not None:
            n = min(n, PROMPT_LOGPROBS_CHUNK)
        return n

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The step `out` took `seconds` to run: the cost model learns from it."""
        predicted = self.policy.cost.predict(out.shape)
        self.policy.observe(out.shape, seconds)
        self.last_step = StepReport(
            out.shape.prefill_tokens,
            out.shape.decodes,
            predicted,
            seconds,
            self.policy.itl_target_s(),
            self.policy.cost.abs_error,
            self.policy.margin,
        )

    def _allocate(self, req: Request, n: int, computed: ComputedPrefix | None = None) -> bool:
        """allocate_slots, unpinning idle sessions (least recently active first) while
        memory is short."""
        if self.kv.allocate_slots(req, n, computed):
            return True
        # Sessions whose next turn is queued lose their pins last, not never: a pin must
        # not block the very request it waits behind.
        protected = {r.session_id for r in self.waiting if r.session_id is not None}
        while self.kv.pins.evict_oldest(protected) or self.kv.pins.evict_oldest():
            if self.kv.allocate_slots(req, n, computed):
                return True
        return False

    def _grant(self, req: Request, n: int, out: SchedulerOutput, scheduled: set[str]) -> bool:
        """Allocate n more tokens for a running request, first unpinning idle sessions,
        then preempting the newest requests not yet scheduled this step (possibly `req`
        itself) until it fits."""
        while not self._allocate(req, n):
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        self._emit(req, n, out, scheduled)
        return True

    def _emit(self, req: Request, n: int, out: SchedulerOutput, scheduled: set[str]) -> None:
        start = req.num_computed_tokens
        block_ids = self.kv.block_ids(req.request_id)
        samples = start + n == req.num_tokens
        forks = tuple(req.forks) if samples else ()
        out.scheduled.append(ScheduledRequest(req, start, n, samples, block_ids, forks))
        scheduled.add(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens now have K/V in the cache."""
        for s in out.scheduled:
            if s.request.is_finished:
                continue  # failed during the step; its blocks are gone
            s.request.num_computed_tokens = s.start + s.num_tokens
            self.kv.cache_full_blocks(s.request)
            self.kv.release_behind_window(s.request)
            if s.forks:
                self._fork(s.request, s.forks)

    def accept(self, req: Request, token: int) -> Accepted:
        """Append a request's sampled token (a replayed one in its place: the request takes
        up another's output, EngineRequest.replay_ids) and check the token-level stops. The
        request is not finished here: its text may stop it yet (the engine's output stage),
        which then calls finish()."""
        replayed = req.num_output_tokens < len(req.replay_ids)
        if replayed:
            token = req.replay_ids[req.num_output_tokens]
        req.append_output_token(token)
        return Accepted(token, replayed, self.check_stop(req, token))

    def check_stop(self, req: Request, token: int) -> FinishReason | None:
        """After `token` was appended: a stop token, the response_format's value complete
        (only a stop could follow), or the length limit; None: it goes on."""
        if token in req.stop_token_ids:
            return FinishReason.STOP  # its text is never shown
        if req.grammar is not None:
            if not req.grammar.accept(token):
                raise RuntimeError(f"token {token} broke the response_format grammar")
            if req.grammar.must_end(self.vocab_size):
                return FinishReason.STOP
        limit = self.max_model_len
        if req.num_output_tokens >= req.max_tokens or (limit and req.num_tokens >= limit):
            return FinishReason.LENGTH
        return None

    def _fork(self, parent: Request, forks: tuple[Request, ...]) -> None:
        """The parent's prompt is computed: its other choices take its blocks by
        reference and run from here (their first tokens were sampled this step)."""
        for child in forks:
            if child.is_finished:
                continue  # aborted before its prompt was computed
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.timings.first_scheduled = parent.timings.first_scheduled
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        parent.forks = []

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Stop a request for good (any status). Its blocks are freed, or become its
        session's pin (what it computed stays valid even when it was cancelled)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            if reason is FinishReason.ERROR:
                self.kv.free(req)
            else:
                self.kv.free_or_pin(req)
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)  # holds no blocks; its session keeps its old pin
            self.kv.forget_lookup(req)
        # (A choice not yet forked is in neither queue: it holds nothing.)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.timings.finished = time.monotonic()
