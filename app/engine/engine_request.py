"""EngineRequest: what a caller asks the engine for, as one frozen value.

It crosses every seam between a caller and an engine: LLMEngine.add_request and
make_request, AsyncEngine.generate, the EngineClient protocol, the Ray cluster and its
replicas, and the fake engine of the web tests. A new per-request option is one field
here, not a parameter restated in eight signatures (vLLM's `EngineCoreRequest` plays the
same part). The engine's own progress on a request lives on `Request`, never here.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.engine.errors import BadParameter
from app.engine.request import SamplingParams


def _new_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class EngineRequest:
    """A generation as asked for.

    `prompt` is text (tokenized by the engine) or token ids (kept as a tuple: the value
    cannot change after it was handed over). A `session_id` keeps the request's K/V pinned
    for the session's next turn; `use_prefix_cache=False` computes every prompt token;
    requests with different `cache_salt`s never share prefix-cache blocks (one tenant cannot
    find another's). `routing_key` tells an engine of several replicas which requests
    belong together (an API client's `user`): they go where their K/V is. One engine
    ignores it."""

    prompt: str | Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=_new_id)
    session_id: str | None = None
    use_prefix_cache: bool = True
    cache_salt: str | None = None
    routing_key: str | None = None
    # Progress of a request this one takes up (app.engine.continuation builds these):
    # output tokens re-derived before it generates, each fed back by a decode step of its
    # own as it was first decoded, so that the K/V and the seed's random stream end where an
    # uninterrupted run's did (docs/determinism.md says how closely in bf16). The sampler
    # still draws for them, its pick is replaced, and they produce no output: the caller
    # has them. Part of max_tokens.
    replay_ids: tuple[int, ...] = ()
    # Draws of the seed's random stream already spent: a request whose prompt carries
    # another's output samples on from where that one stopped.
    seed_offset: int = 0

    def __post_init__(self) -> None:
        if self.params is None:  # "the defaults", as callers of an optional argument say
            object.__setattr__(self, "params", SamplingParams())
        if self.request_id is None:
            object.__setattr__(self, "request_id", _new_id())
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", tuple(self.prompt))
        object.__setattr__(self, "replay_ids", tuple(self.replay_ids))
        self._check_progress()

    def _check_progress(self) -> None:
        offset, params = self.seed_offset, self.params
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise BadParameter(f"seed_offset must be >= 0, got {offset!r}", "seed_offset")
        if not self.replay_ids:
            return
        why = None
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.replay_ids):
            why = "must be token ids >= 0"
        elif params.n != 1:
            why = "need n = 1"
        elif params.logprobs is not None or params.prompt_logprobs is not None:
            why = "cannot be combined with logprobs"
        elif params.max_tokens is not None and len(self.replay_ids) >= params.max_tokens:
            why = f"must be fewer than max_tokens ({params.max_tokens})"
        if why is not None:
            raise BadParameter(f"replay_ids {why}", "replay_ids")
