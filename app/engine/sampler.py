"""Next-token selection for a batch of requests: penalties, temperature, top-k / top-p /
min-p filters, then one random draw per sampled row.

The semantics follow transformers and vLLM (repetition penalty over prompt and output,
top-p computed on what top-k left) and OpenAI (presence and frequency penalties over the
output). Sampling uses the exponential race: argmax(p / q) with q ~ Exp(1) picks token i
with probability p_i, and it needs exactly V numbers from the row's own generator, so a
seeded request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain
from typing import Protocol

import torch

from app.engine.request import SamplingParams

# Cumulative probabilities within this of top_p count as reaching it: softmax and cumsum
# in float32 are off by a few ulps, and a tie must not decide on rounding noise.
_TOP_P_SLACK = 1e-6


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
    outputs = _keys([states[i].output_token_ids for i in rows], rows, vocab)
    if any(r != 1.0 for r in repetition):
        # Prompts can be long: read them only for rows that have a repetition penalty.
        prompts = [
            states[i].prompt_token_ids if r != 1.0 else ()
            for i, r in zip(rows, repetition, strict=True)
        ]
        seen = torch.cat([_keys(prompts, rows, vocab), outputs]).unique()
        penalty = _per_row(repetition, rows, len(states))[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)

    keys, counts = outputs.unique(return_counts=True)  # one key per (row, token) that occurs
    row = keys // vocab
    presence = _per_row([states[i].params.presence_penalty for i in rows], rows, len(states))
    frequency = _per_row([states[i].params.frequency_penalty for i in rows], rows, len(states))
    flat.index_add_(0, keys, -(presence[row] + frequency[row] * counts).to(flat.dtype))


def _keys(token_lists: Sequence[Sequence[int]], rows: list[int], vocab: int) -> torch.Tensor:
    """int64 [sum of lengths]: row * vocab + token for every token of every list, the lists
    belonging to batch rows `rows`."""
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
        # An id out of range would land on a neighbour row's logits instead of failing.
        raise ValueError(f"token id outside the vocabulary of {vocab} logits")
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    return row_of * vocab + tokens


def _per_row(values: list[float], rows: list[int], batch: int) -> torch.Tensor:
    """float32 [batch]: values[j] at rows[j], 0 elsewhere."""
    out = torch.zeros(batch)
    out[rows] = torch.tensor(values)
    return out


class Sampler:
    """Batched next-token selection. Stateless: each request's randomness lives in its
    own generator."""

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """logits: float32 [B, V], one row per state, in order (modified in place).
        Returns int64 [B] token ids."""
        params = [s.params for s in states]
        if any(p.uses_penalties for p in params):
            logits = logits.contiguous()  # a no-op unless the caller passed a strided view
            apply_penalties(logits, states)
        sampled = [i for i, p in enumerate(params) if p.temperature != 0]
        if not sampled:  # the hot path: all greedy
            return logits.argmax(dim=-1)

        if len(sampled) == len(params):
            return self._sample(logits, params, states)
        tokens = logits.argmax(dim=-1)  # greedy rows keep these
        idx = torch.tensor(sampled, dtype=torch.long)
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
        temperature = torch.tensor([p.temperature for p in params], dtype=x.dtype)
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
            floor = torch.tensor([_log(p.min_p) for p in params], dtype=x.dtype)
            x.masked_fill_(x < floor.view(num_rows, 1), -math.inf)

        probs = x.softmax(dim=-1)
        race = torch.empty_like(probs)  # [R, V]
        for row, state in enumerate(states):
            race[row].exponential_(generator=state.generator)
        # Exp(1) can round to 0; a floor keeps p / q finite and a masked token at 0.
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        return probs.div_(race).argmax(dim=-1)


def _mask_top_k_top_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Set to -inf, in place in x [R, V], what top_k and then top_p (on the distribution
    top_k left) drop. top_k keeps the k largest logits and any tied with the k-th."""
    num_rows, vocab = x.shape
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_k = top_k.view(num_rows, 1)
    if all(p.top_p >= 1.0 for p in params):
        # top_k alone needs each row's k-th largest logit only: topk is far cheaper than
        # sorting the whole vocabulary.
        largest = x.topk(int(top_k.max()), dim=-1).values  # [R, max k], descending
        x.masked_fill_(x < largest.gather(1, top_k - 1), -math.inf)
        return

    ordered, order = x.sort(dim=-1, descending=True)  # [R, V] each; one sort for all rows
    drop = ordered < ordered.gather(1, top_k - 1)  # [R, V], in sorted order
    probs = ordered.masked_fill(drop, -math.inf).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
    # top_p == 1 must keep every token, even when the cumsum reaches 1 early.
    top_p = torch.tensor(
        [p.top_p - _TOP_P_SLACK if p.top_p < 1.0 else math.inf for p in params],
        dtype=probs.dtype,
    )
    drop |= before >= top_p.view(num_rows, 1)
    drop[:, 0] = False  # the top token always stays, whatever top_p and the rounding say
    x.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), -math.inf)


def _log(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf
