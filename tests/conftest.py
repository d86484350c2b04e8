"""Shared fixtures. The real model (SmolLM2-135M-Instruct) loads once per session; unit
tests use a tiny random model built in the test instead."""

from __future__ import annotations

import pytest
import torch

from app.config import ModelConfig
from app.model.loader import LoadedModel, load_model
from tests.redis_server import RedisServer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model(ModelConfig())


@pytest.fixture(scope="session")
def tokenizer(smollm: LoadedModel):
    return smollm.tokenizer


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of the test's own on a free loopback port (skipped where absent)."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.close()
