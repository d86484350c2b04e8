"""The real model behind the real server, for the official `openai` client: what the
modules here share. The fixtures are module-scoped: each module gets a server of its own."""

from __future__ import annotations

import openai
import pytest

from app.config import CacheConfig, EngineConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.server.app import create_app
from tests.e2e.live_server import live_server


@pytest.fixture(scope="module")
def server(smollm):
    """A server on 127.0.0.1 over a 128 MiB pool; `server.engine` is its AsyncEngine."""
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(128 << 20)), smollm))
    with live_server(create_app(engine=engine)) as s:
        s.engine = engine
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
