"""How much prefill a step takes, and which waiting request comes next. The scheduler
asks; the policy never allocates. Two policies: StaticPolicy (fixed constants, first come
first served: `--batching static`) and AdaptivePolicy (the default), below.

Budget (Sarathi-Serve's stall-free batching, with the budget from a measured cost model
instead of a constant): while requests decode, every one of them waits for the whole
step, so a step takes as many prefill tokens as keep its predicted time within the
inter-token target. With nothing decoding, a prompt takes the whole token budget (time
to first token as good as one forward).

The default target is AUTO_TARGET_FACTOR times the measured decode-only step: a step whose
decodes are a tenth of it, so that prompts computed beside decodes run at ~90% of their
rate alone (a queue drains at the rate prompts are computed). The target is a promise to
those decoding: a deep queue does not stretch it.

The cost model is unbiased but not exact: a step it predicts at the target runs over it
about half the time, and by up to ~30% (its error is ~7% on average here). So chunks are
sized against the target divided by a margin: the MARGIN_QUANTILE of measured / predicted
over recent steps that carried a chunk beside decodes, learned like the model itself. A
chunk planned that way overruns the target in about one step of ten, and then by the
model's tail over its MARGIN_QUANTILE (~1.13x), so inter-token p99 stays near the target.

Order: earliest deadline first, where a request's deadline is its arrival plus
SLACK_MULTIPLE times its own predicted prefill time alone. A short question passes a long
paste that arrived up to SLACK_MULTIPLE x (the paste's prefill - its own) before it; among
prompts of one size it is first come, first served. One order covers prompts under way and
waiting requests alike: each takes its chunk of the step's prefill in turn (a waiting one by
being admitted), and only the first is owed MIN_CHUNK tokens when the target leaves none. A
preempted request goes first (it has made progress to lose).

The bound: a request is passed only by requests that arrived before it or within
SLACK_MULTIPLE x its own prefill time after it; so (on one machine that never idles with
work queued) it waits at most what first come, first served would make it wait plus the
work of that window's arrivals. A deadline never turns a paste into a wall in front of
the questions behind it. (The designs this replaced, and what they measured:
bench/README.md, "Adaptive batching".)
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

import numpy as np

from app.config import SchedulerConfig
from app.engine.cost_model import StepCostModel, StepShape
from app.engine.request import Request

AUTO_TARGET_FACTOR = 10.0  # auto target: this x the recent decode-only step time
DEFAULT_TARGET_S = 0.1  # until a decode-only step has been measured
SLACK_MULTIPLE = 1.0  # deadline: arrival + this x the request's prefill time alone
MIN_CHUNK = 16  # one prompt a step progresses beside decodes, whatever the target
MARGIN_QUANTILE = 0.9  # of measured / predicted, for steps carrying a chunk beside decodes
MARGIN_STEPS = 128  # such steps remembered
MIN_MARGIN_STEPS = 16  # before this many, no margin
MAX_MARGIN = 2.0


# A prompt token attending to this many earlier tokens costs about twice one attending to
# none (SmolLM2-135M on 2 CPU cores): the static policy's chunks shrink as their context
# grows, so a step that carries one costs about the same early and late in a long prompt.
CONTEXT_COST_TOKENS = 1024


class StaticPolicy:
    """Fixed rules: beside decodes, a prompt chunk of at most
    `prefill_chunk_while_decoding / (1 + context / CONTEXT_COST_TOKENS)` tokens; admission
    in arrival order. Steps are timed all the same (for /metrics)."""

    def __init__(self, cfg: SchedulerConfig, cost: StepCostModel | None = None) -> None:
        self.cfg = cfg
        self.cost = cost or StepCostModel()
        self.margin = 1.0  # no target, nothing planned against one

    def itl_target_s(self) -> float | None:
        return None

    def prefill_tokens(self, step: StepShape, computed: int, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        if step.decodes:
            cap = self.cfg.prefill_chunk_while_decoding / (1 + computed / CONTEXT_COST_TOKENS)
            n = min(n, max(1, int(cap)))
        return n

    def observe(self, step: StepShape, seconds: float) -> None:
        self.cost.observe(step, seconds)

    def prefill_order(self, prefills: list[Request], waiting: Sequence[Request]) -> list[Request]:
        """Prompts under way in admission order, then the waiting in arrival order."""
        return [*prefills, *waiting]


class AdaptivePolicy:
    """Per-step prefill budgets and the admission order, from a StepCostModel."""

    def __init__(self, cfg: SchedulerConfig, cost: StepCostModel | None = None) -> None:
        self.cfg = cfg
        self.cost = cost or StepCostModel()
        self._decode_steps: deque[float] = deque(maxlen=64)  # decode-only step seconds
        self._overruns: deque[float] = deque(maxlen=MARGIN_STEPS)  # measured / predicted
        self.margin = 1.0  # chunks beside decodes are planned to target / margin

    # -- the budget --------------------------------------------------------------------

    def itl_target_s(self) -> float:
        """The inter-token target: the flag's, or AUTO_TARGET_FACTOR x the recent
        decode-only step time."""
        if self.cfg.itl_target_ms is not None:
            return self.cfg.itl_target_ms / 1000
        if not self._decode_steps:
            return DEFAULT_TARGET_S
        return AUTO_TARGET_FACTOR * statistics.median(self._decode_steps)

    def prefill_tokens(self, step: StepShape, computed: int, remaining: int, budget: int) -> int:
        """Tokens of a prompt (computed up to `computed`, `remaining` to go) to add to a
        step already holding `step`, within the step's token `budget`: beside decodes, as
        many as keep the step's predicted time within the target divided by the margin."""
        most = min(remaining, budget)
        if most <= 0:
            return 0
        if step.decodes == 0:
            return most  # nobody waits on this step's time
        limit = self.itl_target_s() / self.margin
        if self.cost.predict(step.plus_prefill(most, computed)) <= limit:
            return most
        # The largest chunk within the limit (cost grows with n: binary search).
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.predict(step.plus_prefill(mid, computed)) <= limit:
                lo = mid
            else:
                hi = mid - 1
        if step.prefill_tokens:
            return lo  # another prompt already progresses this step
        return max(lo, min(MIN_CHUNK, most))

    def observe(self, step: StepShape, seconds: float) -> None:
        """A step took `seconds` (the engine measures every step)."""
        if step.decodes and step.prefill_tokens:  # a step whose chunk this policy sized
            predicted = self.cost.predict(step)
            if predicted > 0:
                self._overruns.append(seconds / predicted)
                if len(self._overruns) >= MIN_MARGIN_STEPS:
                    tail = float(np.quantile(self._overruns, MARGIN_QUANTILE))
                    self.margin = min(max(1.0, tail), MAX_MARGIN)
        self.cost.observe(step, seconds)
        if step.decodes and not step.prefill_tokens:
            self._decode_steps.append(seconds)

    # -- the order ---------------------------------------------------------------------

    def deadline(self, request: Request) -> float:
        """When the request should be served by: its arrival plus SLACK_MULTIPLE x its
        prompt's predicted time alone (the whole prompt: the deadline does not move)."""
        alone = self.cost.predict(
            StepShape(prefill_tokens=request.num_tokens, context=request.num_tokens**2 // 2)
        )
        return request.timings.arrival + SLACK_MULTIPLE * alone

    def prefill_order(self, prefills: list[Request], waiting: Sequence[Request]) -> list[Request]:
        """Prompts under way and waiting requests together, in the order they take a step's
        prefill: preempted ones first (arrival order), then the earliest deadline."""

        def key(request: Request) -> tuple[bool, float]:
            if request.num_preemptions:
                return (False, request.timings.arrival)
            return (True, self.deadline(request))

        return sorted([*prefills, *waiting], key=key)


BatchPolicy = StaticPolicy | AdaptivePolicy


def make_policy(cfg: SchedulerConfig) -> BatchPolicy:
    return AdaptivePolicy(cfg) if cfg.batching == "adaptive" else StaticPolicy(cfg)
