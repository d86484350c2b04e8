"""How low any scheduling order could bring time to first token, for one run's arrivals.

A prompt's first token needs its whole prefill, and one engine computes one step at a
time. Given each request's arrival and `work` (the seconds its prompt takes to compute
with the machine to itself), no order can beat:

- each request's own work (pointwise): a request is no faster than alone;
- first come, first served on the work alone, for the largest flow time: on one machine,
  with release times and preemption allowed, FIFO minimises the largest completion minus
  release (Jackson's rule with due dates equal to release dates);
- for the second largest: whichever request a schedule finishes last, the others form a
  schedule of all but that one, so the second largest is at least the smallest FIFO
  maximum over the sets that leave one request out.

With up to 101 requests a p99 lies at or between the two largest, where these bounds
bite; beyond that only the pointwise floor does.

Decodes and step overheads only add time, so leaving them out keeps these floors. Any
percentile (nearest rank or interpolated) grows with each sorted value, so the percentile
of these floors, sorted, is a floor on the percentile of the measured values. `latency` is
added to every flow: what a lone prompt pays besides its compute (the last step's fixed
cost, the round trip).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def fifo_max_flow(arrivals: Sequence[float], work: Sequence[float]) -> float:
    """The largest completion - arrival when requests are served whole in arrival order
    (the least any order achieves on one machine)."""
    clock, worst = -math.inf, 0.0
    for at, w in sorted(zip(arrivals, work)):
        clock = max(clock, at) + w
        worst = max(worst, clock - at)
    return worst


def quantile(values: Sequence[float], q: float) -> float:
    """numpy's default (linear) quantile."""
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ttft_floors(
    arrivals: Sequence[float], work: Sequence[float], latency: float = 0.0
) -> list[float]:
    """Floors on the sorted times to first token, smallest first, that no order beats:
    the k-th smallest TTFT of any schedule is at least the k-th value returned."""
    arrivals, work = list(arrivals), list(work)
    n = len(work)
    floors = sorted(w + latency for w in work)
    if n >= 1:
        floors[-1] = max(floors[-1], fifo_max_flow(arrivals, work) + latency)
    if n >= 2:
        second = min(
            fifo_max_flow(arrivals[:i] + arrivals[i + 1 :], work[:i] + work[i + 1 :])
            for i in range(n)
        )
        floors[-2] = max(floors[-2], second + latency)
    return floors
