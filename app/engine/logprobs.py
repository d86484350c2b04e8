"""Log-probabilities of tokens, for the requests that ask (OpenAI's `logprobs`,
`top_logprobs` and `echo`).

They come from the same logits that sampling starts from: the model's output in fp32,
before logit_bias, penalties, temperature, top-k/top-p/min-p and response_format masks
(vLLM's default, "raw" logprobs). So they describe the model, not the sampler: a token
picked under a JSON mask may have a low logprob. One log_softmax over the rows that ask,
one gather and one top-k for the whole batch; a step where nobody asks does none of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability and the `k` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def token_logprobs(
    logits: torch.Tensor,  # [R, V] the model's logits (not modified)
    token_ids: torch.Tensor,  # [R] int64: the token each row chose or was given
    top_k: Sequence[int],  # R counts of alternatives (0: the token alone)
) -> list[Logprob]:
    """The log-probability of token_ids[r] under row r, with row r's top_k[r] best."""
    logp = logits.float().log_softmax(dim=-1)  # [R, V], a new tensor: logits stay as is
    chosen = logp.gather(1, token_ids.view(-1, 1)).view(-1).tolist()
    ids = token_ids.tolist()
    k = max(top_k, default=0)
    if k == 0:
        return [Logprob(t, lp) for t, lp in zip(ids, chosen, strict=True)]
    values, indices = logp.topk(k, dim=-1)  # [R, k], most likely first
    values_l, indices_l = values.tolist(), indices.tolist()
    return [
        Logprob(t, lp, tuple(zip(indices_l[r][: top_k[r]], values_l[r][: top_k[r]], strict=True)))
        for r, (t, lp) in enumerate(zip(ids, chosen, strict=True))
    ]
