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

    def __post_init__(self) -> None:
        if self.params is None:  # "the defaults", as callers of an optional argument say
            object.__setattr__(self, "params", SamplingParams())
        if self.request_id is None:
            object.__setattr__(self, "request_id", _new_id())
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", tuple(self.prompt))
