"""EngineClient: the one surface through which the server talks to an engine.

AsyncEngine (one engine in this process), a Ray cluster of replicas and the fake engine
of the fast web tests all stand behind it; the server never asks which one it has, and
never probes for a method. Every call the server makes is listed here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from app.engine.engine_request import EngineRequest
from app.engine.outputs import EngineListener, EngineStats, ModelInfo, RequestOutput


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

    def generate(self, asked: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes; leaving early aborts it. With
        params.n > 1 the outputs of its n choices interleave, told apart by their `index`,
        and the stream ends when every choice has finished.

        Raises BadParameter / ContextTooLong (before anything is queued), Overloaded
        when the queue is full, EngineDead when nothing can serve it. What each of the
        request's fields asks for: EngineRequest.
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
