"""What the engine hands out: per-step outputs of a request, the frozen record of a
finished one, counters, and what callers need to know about the model.

Each is a snapshot: a caller (another thread, another process) may keep it as long as it
likes; nothing in it changes when the engine moves on.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.engine.logprobs import Logprob
from app.engine.request import FinishReason, Request, Timings
from app.kvtier.stats import TierStats


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one choice of a request. Text, token ids and logprobs
    are deltas. `request_id` is the caller's; `index` tells a request's choices apart
    (n > 1), and `finished` is about this choice."""

    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    timings: Timings
    index: int = 0
    logprobs: list[Logprob] | None = None  # one per new token id, when asked for
    # Once, on choice 0's first output: one per prompt token, the first None (echo).
    prompt_logprobs: list[Logprob | None] | None = None
    tier_cached_tokens: int = 0  # of cached_tokens, those loaded from the KV tier

    def merge(self, later: RequestOutput) -> RequestOutput:
        """Fold a later output of the same choice into this one (a slow reader gets
        one bigger delta instead of a backlog)."""
        assert later.index == self.index, "only outputs of one choice merge"
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = (logprobs or []) + later.logprobs
        return RequestOutput(
            request_id=self.request_id,
            new_text=self.new_text + later.new_text,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            finished=later.finished,
            finish_reason=later.finish_reason,
            prompt_tokens=later.prompt_tokens,
            cached_tokens=later.cached_tokens,
            completion_tokens=later.completion_tokens,
            timings=later.timings,
            index=self.index,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            tier_cached_tokens=later.tier_cached_tokens,
        )


@dataclass(frozen=True)
class FinishedRequestStats:
    """A finished request's figures, frozen when it ended (for metrics and tracing)."""

    request_id: str
    session_id: str | None
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int
    timings: Timings  # a copy: the request's own keeps no link to it

    @classmethod
    def of(cls, req: Request) -> FinishedRequestStats:
        assert req.finish_reason is not None, "only a finished request has final stats"
        forked = req.index > 0  # its prompt was computed once, for choice 0: count it once
        return cls(
            request_id=req.request_id,
            session_id=req.session_id,
            finish_reason=req.finish_reason,
            num_prompt_tokens=0 if forked else req.num_prompt_tokens,
            num_cached_tokens=0 if forked else max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            num_preemptions=req.num_preemptions,
            timings=copy.copy(req.timings),
        )


class EngineListener(Protocol):
    """Told, on the engine's thread, about tokens and finished requests (metrics,
    tracing). Listeners get ids and frozen records, never a live request."""

    def on_tokens(self, request_id: str, num_tokens: int, gap_s: float | None) -> None:
        """`num_tokens` new output tokens; `gap_s` since the previous ones, if any."""

    def on_finished(self, stats: FinishedRequestStats) -> None:
        """The request ended (any reason)."""


@dataclass(frozen=True)
class StepReport:
    """The last step as the policy saw it, for /metrics."""

    prefill_tokens: int = 0  # the budget it chose (prefill tokens granted)
    decodes: int = 0
    predicted_s: float = 0.0
    measured_s: float = 0.0
    itl_target_s: float | None = None
    model_error: float = 0.0  # the cost model's mean relative error, recent steps
    itl_margin: float = 1.0  # chunks beside decodes are planned to itl_target_s / this


@dataclass(frozen=True)
class ReplicaStats:
    """One engine replica, as its front sees it (several replicas: app.cluster)."""

    name: str
    live: bool
    in_flight: int  # requests the front has sent it and not yet seen end
    num_running: int
    num_waiting: int
    kv_usage: float
    cpu_threads: int = 0  # threads its last step ran with (0: not on the CPU, or unknown)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics, logs and benchmarks."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of blocks held
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    pin_hits: int
    sessions_pinned: int
    pinned_blocks: int
    session_unpins: dict[str, int]
    steps: int
    step: StepReport | None = None  # the last step: budget, predicted and measured time
    replicas: tuple[ReplicaStats, ...] = ()  # empty for one engine in this process
    routing: dict[str, int] = field(default_factory=dict)  # decisions by kind (affine, ...)
    tier_hits: int = 0  # prompt tokens loaded from the KV tier (not in prefix_hits)
    tier: TierStats | None = None  # None: no KV tier
    # Of the K/V pool: the blocks written at least once, less what local layers gave back
    kv_resident_bytes: int = 0
    # Inter-token gaps as the engine saw them, held against the policy's target (none
    # counted without one): how many, and how many over each of ITL_OVER x the target.
    itl_gaps: int = 0
    itl_gaps_over: tuple[int, ...] = ()
    cpu_threads: int = 0  # threads the last step ran with (0: not on the CPU)
    thread_changes: int = 0  # times the thread policy changed the count (app.engine.threads)


ITL_OVER = (1.0, 1.2, 1.5, 2.0)  # multiples of the inter-token target counted in EngineStats


@dataclass(frozen=True)
class ModelInfo:
    """What callers of an engine need to know about the model it serves. The tokenizer
    builds prompts on the caller's side (chat templates, token counts)."""

    name: str
    max_model_len: int
    eos_token_ids: frozenset[int]
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
