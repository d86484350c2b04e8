"""top_p over a large vocabulary: the candidate fast path and the full-sort fallback both
keep exactly the nucleus a plain float64 reference computes."""

import math

import torch

from app.engine.request import SamplingParams
from app.engine.sampler import TOP_P_CANDIDATES, _mask_top_k_top_p


def reference_keep(row: torch.Tensor, p: SamplingParams) -> set[int]:
    x = row.double()
    order = x.argsort(descending=True).tolist()
    if 0 < p.top_k < len(order):
        kth = x[order[p.top_k - 1]]
        order = [i for i in order if x[i] >= kth]
    probs = torch.softmax(x[order], dim=0).tolist()
    kept, mass = [], 0.0
    for i, q in zip(order, probs):
        if kept and mass >= p.top_p:
            break
        kept.append(i)
        mass += q
    return set(kept)


def test_fast_path_and_fallback_agree_with_the_reference():
    vocab = 3 * TOP_P_CANDIDATES
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(vocab, generator=g) * 6  # nucleus of a few tokens
    flat = torch.randn(vocab, generator=g) * 0.1  # nucleus of thousands: needs the sort
    rows = [peaked, flat, peaked, flat, flat]
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, top_k=40),
        SamplingParams(top_p=0.99, top_k=2000),  # top_k beyond the candidate set
        SamplingParams(top_p=0.3, top_k=100),  # top_k inside it: no sort needed
    ]
    x = torch.stack(rows)
    _mask_top_k_top_p(x, params)
    for row, masked, p in zip(rows, x, params):
        kept = set(torch.isfinite(masked).nonzero().view(-1).tolist())
        assert kept == reference_keep(row, p)
    assert len(set(torch.isfinite(x[1]).nonzero().view(-1).tolist())) > TOP_P_CANDIDATES
    assert math.isinf(x[0].min().item())
