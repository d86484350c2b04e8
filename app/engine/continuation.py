"""Continuation: taking up a request that was cut, from what its caller already has.

A reply is cut when its replica dies (app.cluster) or its server restarts (a journaled
turn, app.server.turn_runner). Both callers know the prompt's token ids, the output ids
they were sent and the sampling parameters; the server also knows the text its clients
were shown. From those plain values a Continuation decides how the reply goes on and what
the caller's usage becomes, in one place:

- Replay (up to REPLAY_MAX_TOKENS of output, n = 1, no logprobs): the new request has the
  old prompt and re-derives the output so far by one decode step a token
  (EngineRequest.replay_ids). Its K/V, its sampler's random stream, its penalties and its
  detokenizer then stand where the uninterrupted run's did; only what follows comes out.
  In fp32 greedy and seeded replies go on token for token, and with bf16 activations far
  closer than from a prefill (docs/determinism.md).
- Prefill (longer outputs, which would cost as many decode steps): the new request's
  prompt is the old prompt plus the output so far, computed in one prefill. Where the
  caller knows the text it was shown, the output is cut back to the last token whose text
  it wholly had (a character split over tokens, or text held back as a possible stop
  string, is generated again), and the first characters of the new text, which it had,
  are skipped. max_tokens shrinks by the tokens kept and the seed's random stream moves
  on past them (EngineRequest.seed_offset). That continues exactly in fp32 only, and
  presence and frequency penalties no longer count the output before the cut (it is now
  prompt).

Either way the caller's request keeps its own usage: its prompt, and every output token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.engine.engine_request import EngineRequest
from app.engine.outputs import FinishedRequestStats, RequestOutput
from app.engine.request import SamplingParams

# Up to this many output tokens are replayed, one decode step each (~10 ms for one
# request on 2 cores, so ~5 s at most); past it they are recomputed in one prefill, which
# is cheaper but parts from the uninterrupted reply where bf16 rounds differently.
REPLAY_MAX_TOKENS = 512


@dataclass(frozen=True)
class Continuation:
    """How a cut request goes on (build it with `Continuation.of`)."""

    prompt_ids: tuple[int, ...]  # the cut request's own prompt
    kept_ids: tuple[int, ...]  # its output that the new request carries (replayed or prompt)
    replays: bool  # True: kept_ids are replayed; False: they are part of the prompt
    skip: int  # characters at the start of the new text that the caller had already
    params: SamplingParams  # the new request's (max_tokens moved on by a prefill's kept)

    @classmethod
    def of(
        cls,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        params: SamplingParams,
        shown: str | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> Continuation | None:
        """The continuation of a request with `prompt_ids` and `params` after the output
        `output_ids`; None when its token budget is spent already. `shown` (the text the
        caller's clients were sent) and `decode` (ids -> text, as the request's
        detokenizer would) let a prefill cut back to that text; without them every
        output token is kept."""
        prompt, ids = tuple(prompt_ids), list(output_ids)
        no_logprobs = params.logprobs is None and params.prompt_logprobs is None
        if params.n == 1 and no_logprobs and len(ids) <= REPLAY_MAX_TOKENS:
            if params.max_tokens is not None and len(ids) >= params.max_tokens:
                return None
            return cls(prompt, tuple(ids), True, 0, params)
        keep, skip = len(ids), 0
        if shown is not None and decode is not None:
            keep, skip = _cut(ids, shown, decode)
        if params.max_tokens is not None and params.max_tokens - keep < 1:
            return None
        left = None if params.max_tokens is None else params.max_tokens - keep
        after = dataclasses.replace(params, max_tokens=left)
        return cls(prompt, tuple(ids[:keep]), False, skip, after)

    @property
    def carried(self) -> int:
        """Output tokens in the new request's prompt: its usage leaves them out."""
        return 0 if self.replays else len(self.kept_ids)

    def request(self, asked: EngineRequest) -> EngineRequest:
        """`asked` (the cut request's ids, session, salt, ...) as the request that goes on."""
        if self.replays:
            return dataclasses.replace(
                asked, prompt=self.prompt_ids, params=self.params, replay_ids=self.kept_ids
            )
        return dataclasses.replace(
            asked,
            prompt=self.prompt_ids + self.kept_ids,
            params=self.params,
            replay_ids=(),
            seed_offset=asked.seed_offset + len(self.kept_ids),
        )

    def output(self, out: RequestOutput, cached_tokens: int | None = None) -> RequestOutput:
        """The new request's output as the cut request's: its own prompt, every output
        token counted, and (where given) the cached tokens its first start reported."""
        if not self.carried:
            return out
        p, c, n = self._counts(out.cached_tokens, out.completion_tokens, cached_tokens)
        return dataclasses.replace(out, prompt_tokens=p, cached_tokens=c, completion_tokens=n)

    def stats(
        self, stats: FinishedRequestStats, cached_tokens: int | None = None
    ) -> FinishedRequestStats:
        """The new request's final stats as the cut request's (see `output`)."""
        if not self.carried:
            return stats
        p, c, n = self._counts(stats.num_cached_tokens, stats.num_output_tokens, cached_tokens)
        return dataclasses.replace(
            stats, num_prompt_tokens=p, num_cached_tokens=c, num_output_tokens=n
        )

    def _counts(self, cached: int, completion: int, first_cached: int | None) -> tuple[int, ...]:
        """(prompt, cached, completion) tokens of the cut request, from the new one's."""
        cached = cached if first_cached is None else first_cached
        return len(self.prompt_ids), cached, completion + self.carried


def _cut(ids: list[int], shown: str, decode: Callable[[list[int]], str]) -> tuple[int, int]:
    """How many of `ids` to keep (the longest run whose text `shown` starts with, no
    character split), and how many characters of `shown` lie past their text."""
    keep, decoded = len(ids), ""
    while keep > 0:
        decoded = decode(ids[:keep])
        if shown.startswith(decoded) and not decoded.endswith("\ufffd"):
            break
        keep -= 1
    if keep == 0:
        decoded = ""
    return keep, len(shown) - len(decoded)
