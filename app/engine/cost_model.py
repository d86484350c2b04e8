"""What a step costs: a linear model of step time, fitted online from the engine's own
steps.

    time ~ fixed + per_decode * decodes + per_prefill * prefill tokens
           + per_context * attended context

`attended context` counts the K/V rows the step's queries read: a decode reads its whole
context; a prefill chunk of n tokens after c cached ones reads about n * (c + n / 2). On
a CPU the weight matmuls grow with the token count and attention with the context, and
these four terms explain a step well (bench/README.md reports the fit's error). The model
needs no hand-tuned constants: it learns the machine, the model, the dtype and the
weights' format from the last few hundred steps, refitted every few steps by least
squares.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

WINDOW = 512  # steps remembered
REFIT_EVERY = 16
MIN_STEPS = 24  # before this many, predictions use the prior


@dataclass(frozen=True)
class StepShape:
    """What a step computes, as the cost model sees it."""

    decodes: int = 0
    prefill_tokens: int = 0
    context: int = 0  # K/V rows attended, summed over the step's queries

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.decodes), float(self.prefill_tokens), float(self.context))

    def plus_decode(self, context: int) -> StepShape:
        """This step with one more decode attending to `context` K/V rows."""
        return StepShape(self.decodes + 1, self.prefill_tokens, self.context + context)

    def plus_prefill(self, tokens: int, cached: int) -> StepShape:
        """This step with a prefill chunk of `tokens` after `cached` computed ones."""
        return StepShape(
            self.decodes,
            self.prefill_tokens + tokens,
            self.context + tokens * (cached + tokens // 2),
        )


class StepCostModel:
    """Predicts a step's seconds from its shape; learns from observed steps."""

    def __init__(self, prior: tuple[float, float, float, float] = (5e-3, 2e-3, 1e-3, 1e-6)):
        # Until enough steps are seen: a rough prior (a small model on a small CPU), only
        # used to size the first few steps.
        self.coef = np.array(prior, dtype=np.float64)
        self._x: deque[tuple[float, ...]] = deque(maxlen=WINDOW)
        self._y: deque[float] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self.abs_error = 0.0  # mean |predicted - measured| / measured, over recent steps
        self._errors: deque[float] = deque(maxlen=128)
        self._error_sum = 0.0  # of _errors: a running sum, not a mean over 128 every step

    @property
    def steps_seen(self) -> int:
        return len(self._y)

    def predict(self, shape: StepShape) -> float:
        return max(0.0, float(np.dot(self.coef, shape.features())))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step of this shape took `seconds`."""
        if seconds <= 0:
            return
        if self.steps_seen >= MIN_STEPS:
            error = abs(self.predict(shape) - seconds) / seconds
            if len(self._errors) == self._errors.maxlen:
                self._error_sum -= self._errors[0]
            self._errors.append(error)
            self._error_sum += error
            self.abs_error = self._error_sum / len(self._errors)
        self._x.append(shape.features())
        self._y.append(seconds)
        self._since_fit += 1
        if self.steps_seen >= MIN_STEPS and self._since_fit >= REFIT_EVERY:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        x = np.array(self._x)
        y = np.array(self._y)
        # Relative error matters (a 10 ms step off by 10 ms is worse than a 1 s step off by
        # 10 ms): weight each step by 1 / its time. Non-negative costs: clip, then refit
        # the rest (a term the data cannot see keeps the prior's value).
        w = 1.0 / y
        coef = self.coef.copy()
        active = [i for i in range(x.shape[1]) if np.ptp(x[:, i]) > 0 or i == 0]
        for _ in range(x.shape[1]):
            solution, *_ = np.linalg.lstsq(
                x[:, active] * w[:, None], y * w - (x @ _masked(coef, active)) * w, rcond=None
            )
            negative = [a for a, c in zip(active, solution) if c < 0 and a != 0]
            if not negative:
                coef[active] = solution
                break
            for a in negative:
                coef[a] = 0.0
            active = [a for a in active if a not in negative]
        self.coef = coef


def _masked(coef: np.ndarray, active: list[int]) -> np.ndarray:
    """The coefficients that stay fixed while `active` ones are fitted."""
    out = coef.copy()
    out[active] = 0.0
    return out
