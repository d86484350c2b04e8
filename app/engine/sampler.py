"""Next-token selection for a batch of requests: penalties, temperature, top-k / top-p /
min-p filters, then one random draw per sampled row.

The semantics follow transformers and vLLM (repetition penalty over prompt and output,
top-p computed on what top-k left) and OpenAI (presence and frequency penalties over the
output). Sampling inverts the cumulative distribution: one uniform number u from the row's
own generator picks the first token whose cumulative probability exceeds u. One number per
row and step means a seeded request draws the same tokens whatever else shares its batch,
and costs one batched cumsum instead of V random numbers per row (an exponential race
took ~1 ms per row at V = 49,152).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain
from typing import Protocol

import torch

from app.engine.request import SamplingParams
from app.engine.structured import TokenMasks

# Cumulative probabilities within this of top_p count as reaching it: softmax and cumsum
# in float32 are off by a few ulps, and a tie must not decide on rounding noise.
_TOP_P_SLACK = 1e-6
TOP_P_CANDIDATES = 1024


class SamplingState(Protocol):
    """What the sampler reads from a request (`Request` has it; tests pass dataclasses)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def generator(self) -> torch.Generator: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Apply repetition, presence and frequency penalties to `logits` [B, V] in place.

    Rows whose params use no penalty are left untouched. Only the logits of tokens that
    occur are read and written: work grows with the number of tokens, not with B * V.
    """
    rows = [i for i, s in enumerate(states) if s.params.uses_penalties]
    if not rows:
        return
    if not logits.is_contiguous():
        raise ValueError("apply_penalties needs contiguous logits (it writes through a view)")
    vocab = logits.shape[1]
    flat = logits.view(-1)  # [B * V]; a (row, token) pair is the key row * V + token

    repetition = [states[i].params.repetition_penalty for i in rows]
    device = logits.device
    outputs = _keys([states[i].output_token_ids for i in rows], rows, vocab, device)
    if any(r != 1.0 for r in repetition):
        # Prompts can be long: read them only for rows that have a repetition penalty.
        prompts = [
            states[i].prompt_token_ids if r != 1.0 else ()
            for i, r in zip(rows, repetition, strict=True)
        ]
        seen = torch.cat([_keys(prompts, rows, vocab, device), outputs]).unique()
        penalty = _per_row(repetition, rows, len(states), device)[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)

    keys, counts = outputs.unique(return_counts=True)  # one key per (row, token) that occurs
    row = keys // vocab
    presence = _per_row(
        [states[i].params.presence_penalty for i in rows], rows, len(states), device
    )
    frequency = _per_row(
        [states[i].params.frequency_penalty for i in rows], rows, len(states), device
    )
    flat.index_add_(0, keys, -(presence[row] + frequency[row] * counts).to(flat.dtype))


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add each row's logit_bias to `logits` [B, V] in place (OpenAI's logit_bias)."""
    rows, tokens, biases = [], [], []
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            rows.append(i)
            tokens.append(t)
            biases.append(b)
    vocab = logits.shape[1]
    if max(tokens) >= vocab:
        raise ValueError(f"logit_bias names a token id outside the vocabulary of {vocab}")
    device = logits.device
    logits.index_put_(
        (torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
        torch.tensor(biases, dtype=logits.dtype, device=device),
        accumulate=True,
    )


def _keys(
    token_lists: Sequence[Sequence[int]], rows: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """int64 [sum of lengths] on `device`: row * vocab + token for every token of every list,
    the lists belonging to batch rows `rows`. Checked on the host, then copied once."""
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
        # An id out of range would land on a neighbour row's logits instead of failing.
        raise ValueError(f"token id outside the vocabulary of {vocab} logits")
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    return (row_of * vocab + tokens).to(device)  # no copy on the CPU


def _per_row(
    values: list[float], rows: list[int], batch: int, device: torch.device
) -> torch.Tensor:
    """float32 [batch]: values[j] at rows[j], 0 elsewhere."""
    out = torch.zeros(batch, device=device)
    out[rows] = torch.tensor(values, device=device)
    return out


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token: argmax's answer (the first of tied maxima, a NaN's
    index where a row has one), from max's reduction, which PyTorch's CPU build runs ~2.4x
    faster over a 49,152-token vocabulary (one row 84 -> 37 us, 32 rows 1.37 -> 0.55 ms)."""
    return logits.max(dim=-1).indices


class Sampler:
    """Batched next-token selection. Stateless: each request's randomness lives in its
    own generator."""

    def __call__(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        masks: TokenMasks | None = None,
    ) -> torch.Tensor:
        """logits: float32 [B, V], one row per state, in order (modified in place).
        `masks` forbid tokens in some rows (response_format). Returns int64 [B] token ids."""
        params = [s.params for s in states]
        if masks is not None:
            masks.apply(logits)  # first: a forbidden token stays -inf whatever comes next
        if any(p.logit_bias for p in params):
            apply_logit_bias(logits, params)
        if any(p.uses_penalties for p in params):
            logits = logits.contiguous()  # a no-op unless the caller passed a strided view
            apply_penalties(logits, states)
        sampled = [i for i, p in enumerate(params) if p.temperature != 0]
        if not sampled:  # the hot path: all greedy
            return greedy(logits)

        if len(sampled) == len(params):
            return self._sample(logits, params, states)
        tokens = greedy(logits)  # greedy rows keep these
        idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        chosen = [states[i] for i in sampled]
        tokens[idx] = self._sample(logits[idx], [s.params for s in chosen], chosen)
        return tokens

    def _sample(
        self,
        x: torch.Tensor,
        params: Sequence[SamplingParams],
        states: Sequence[SamplingState],
    ) -> torch.Tensor:
        """Temperature, filters and one draw per row; x [R, V] is modified in place."""
        num_rows, vocab = x.shape
        device = x.device
        temperature = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=device)
        # Shift each row's maximum to 0 first: a tiny temperature then sends the other
        # logits to -inf instead of overflowing to inf - inf = nan in the softmax.
        x -= x.amax(dim=-1, keepdim=True)
        x /= temperature.view(num_rows, 1)

        filtered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        if filtered:
            sub = x if len(filtered) == num_rows else x[filtered]
            _mask_top_k_top_p(sub, [params[i] for i in filtered])
            if sub is not x:
                x[filtered] = sub
        if any(p.min_p > 0 for p in params):
            # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p), and x_max is 0 (shifted
            # above, and the filters always keep the top token).
            floor = torch.tensor([_log(p.min_p) for p in params], dtype=x.dtype, device=device)
            x.masked_fill_(x < floor.view(num_rows, 1), -math.inf)

        # The row's maximum is 0 (shifted above, kept by the filters): exp of it is
        # unnormalized probability in (0, 1], and the draw scales by the row's total, so
        # the softmax's own max pass, sum and division would change nothing but the cost.
        cdf = x.exp_().cumsum_(dim=-1)  # [R, V], non-decreasing
        # Drawn on the host from each request's own (CPU) generator: the same numbers on
        # every device, so a seeded request draws the same tokens on a GPU.
        u = torch.stack([torch.rand((), generator=s.generator) for s in states]).to(device)
        target = (u * cdf[:, -1]).unsqueeze(1)  # in [0, total): some token's cdf exceeds it
        # side="right": the first token whose cdf is > target, which has probability > 0,
        # so a masked token (zero mass, flat cdf) is never picked, even when u == 0.
        tokens = torch.searchsorted(cdf, target.to(cdf.dtype), right=True).squeeze(1)
        return tokens.clamp_(max=vocab - 1)


def _mask_top_k_top_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Set to -inf, in place in x [R, V], what top_k and then top_p (on the distribution
    top_k left) drop. top_k keeps the k largest logits and any tied with the k-th."""
    num_rows, vocab = x.shape
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_k = torch.tensor(ks, device=x.device).view(num_rows, 1)
    if all(p.top_p >= 1.0 for p in params):
        # top_k alone needs each row's k-th largest logit only: topk is far cheaper than
        # sorting the whole vocabulary.
        largest = x.topk(max(ks), dim=-1).values  # [R, max k], descending
        x.masked_fill_(x < largest.gather(1, top_k - 1), -math.inf)
        return

    # A nucleus is almost always a few hundred tokens at most: look for it among the
    # largest TOP_P_CANDIDATES logits first (a partial topk, ~7x cheaper than a full sort
    # at 32 x 49,152), and sort the whole row only where that set is too small.
    k = min(vocab, TOP_P_CANDIDATES)
    rows_fit = top_k.view(-1) <= k
    has_top_k = top_k.view(-1) < vocab
    values, order = x.topk(k, dim=-1)  # [R, k], descending
    keep, covered = _nucleus(values, top_k.clamp(max=k), params, x, has_top_k)
    covered |= rows_fit & has_top_k  # top_k <= k: every kept token is a candidate
    covered &= rows_fit | ~has_top_k  # top_k > k: the kept set leaves the candidates
    mask = torch.ones_like(x, dtype=torch.bool).scatter_(1, order, ~keep)
    rest = (~covered).nonzero().view(-1).tolist()
    if rest:
        sub = x[rest]
        ordered, full_order = sub.sort(dim=-1, descending=True)  # [r, V]
        sub_params = [params[i] for i in rest]
        full_keep, _ = _nucleus(ordered, top_k[rest], sub_params, None, None)
        mask[rest] = torch.empty_like(full_keep).scatter_(1, full_order, ~full_keep)
    x.masked_fill_(mask, -math.inf)


def _nucleus(
    ordered: torch.Tensor,  # [R, n] logits sorted descending: a whole row or its top n
    top_k: torch.Tensor,  # [R, 1], each <= n
    params: Sequence[SamplingParams],
    full: torch.Tensor | None,  # [R, V] whole rows when `ordered` is only their top n
    has_top_k: torch.Tensor | None,  # [R] bool, with `full`
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of `ordered` top_k and then top_p keep ([R, n] bool), and whether the kept
    set is complete within `ordered` ([R] bool: the mass there reached top_p)."""
    num_rows = ordered.shape[0]
    drop = ordered < ordered.gather(1, top_k - 1)  # top_k, ties with the k-th kept
    kept = ordered.masked_fill(drop, -math.inf)
    log_norm = kept.logsumexp(dim=-1, keepdim=True)  # [R, 1]
    if full is not None and has_top_k is not None:
        # Without top_k the distribution spans the whole row, not just its top n.
        log_norm = torch.where(has_top_k.view(-1, 1), log_norm, full.logsumexp(-1, True))
    probs = (kept - log_norm).exp()
    cum = probs.cumsum(dim=-1)
    before = cum - probs  # mass of the tokens ranked above
    # top_p == 1 must keep every token, even when the cumsum reaches 1 early.
    top_p = torch.tensor(
        [p.top_p - _TOP_P_SLACK if p.top_p < 1.0 else math.inf for p in params],
        dtype=probs.dtype,
        device=probs.device,
    ).view(num_rows, 1)
    drop |= before >= top_p
    drop[:, 0] = False  # the top token always stays, whatever top_p and the rounding say
    covered = (cum[:, -1:] >= top_p).view(-1)
    return ~drop, covered


def _log(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf
