"""Shared fixtures. The real model (SmolLM2-135M-Instruct) loads once per session; unit
tests use a tiny random model built in the test instead."""

from __future__ import annotations

import pytest
import torch

from app.config import ModelConfig
from app.model.loader import LoadedModel, load_model
from tests.redis_server import redis_server  # noqa: F401  (a real Redis, for any suite)

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model(ModelConfig())


@pytest.fixture(scope="session")
def tokenizer(smollm: LoadedModel):
    return smollm.tokenizer
