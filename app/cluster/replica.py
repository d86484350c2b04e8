"""One engine replica: an AsyncEngine in a Ray actor process of its own.

The actor streams a request's outputs as a Ray streaming generator, then the request's
frozen stats, so that the front's metrics and tracing see what an in-process engine
would tell them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from app.config import EngineConfig
from app.engine.async_engine import AsyncEngine, settle_heap
from app.engine.engine_request import EngineRequest
from app.engine.outputs import EngineStats, FinishedRequestStats, ModelInfo, RequestOutput
from app.model.loader import LoadedModel


class Replica:
    """The actor's body (wrapped by ray.remote in cluster.py)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.engine = AsyncEngine.build(config, loaded)  # see AsyncEngine's docstring
        self._finished: dict[str, FinishedRequestStats] = {}
        self.engine.add_listener(self)
        self.engine.start()
        settle_heap()  # the actor's process is this replica's alone, as the server's is

    # EngineListener, on the engine's thread: keep each request's final stats for its stream.
    def on_tokens(self, request_id: str, num_tokens: int, gap_s: float | None) -> None:
        pass

    def on_finished(self, stats: FinishedRequestStats) -> None:
        self._finished[stats.request_id] = stats

    def info(self) -> ModelInfo:
        return self.engine.info

    def pid(self) -> int:
        return os.getpid()

    def healthy(self) -> bool:
        return self.engine.healthy()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def generate(
        self, asked: EngineRequest
    ) -> AsyncIterator[RequestOutput | FinishedRequestStats]:
        try:
            async for out in self.engine.generate(asked):
                yield out
        finally:
            stats = self._finished.pop(asked.request_id, None)
        if stats is not None:
            yield stats

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def release_session(self, session_id: str) -> None:
        self.engine.release_session(session_id)

    async def stop(self) -> None:
        await self.engine.stop()
