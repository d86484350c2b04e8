"""EngineClient: the one surface through which the server talks to an engine.

AsyncEngine (one engine in this process), a Ray cluster of replicas and the fake engine
of the fast web tests all stand behind it; the server never asks which one it has, and
never probes for a method. Every call the server makes is listed here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from app.engine.outputs import EngineListener, EngineStats, ModelInfo, RequestOutput
from app.engine.request import SamplingParams


class EngineClient(Protocol):
    """An engine as its callers see it."""

    @property
    def info(self) -> ModelInfo:
        """The served model: name, context window, end-of-turn ids, tokenizer."""
        ...

    def start(self) -> None:
        """Start serving (idempotent)."""
        ...

    async def stop(self) -> None:
        """Abort everything and stop; nothing keeps running afterwards."""
        ...

    def healthy(self) -> bool:
        """Whether requests can be served now (the loop, or enough replicas, alive)."""
        ...

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str,
        session_id: str | None = None,
        use_prefix_cache: bool = True,
        cache_salt: str | None = None,
        routing_key: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes; leaving early aborts it. With
        params.n > 1 the outputs of its n choices interleave, told apart by their `index`,
        and the stream ends when every choice has finished.

        Raises BadParameter / ContextTooLong (before anything is queued), Overloaded
        when the queue is full, EngineDead when nothing can serve it. A `session_id` keeps
        the request's K/V pinned for the session's next turn; `cache_salt` keeps its
        prefix-cache entries apart from other salts' (one tenant cannot find another's).
        `routing_key` tells an engine of several replicas which requests belong together
        (an API client's `user`): they go where their K/V is. One engine ignores it.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Cancel a request; its final output says finish_reason "abort"."""
        ...

    def release_session(self, session_id: str) -> None:
        """Let go of a session's pinned K/V now (a deleted conversation)."""
        ...

    def stats(self) -> EngineStats:
        """Counters as of the last step (cheap; any thread)."""
        ...

    def add_listener(self, listener: EngineListener) -> None:
        """Tell `listener` about tokens and finished requests. Before start()."""
        ...
