"""The tiny-engine suites again, with int4 weights and bf16 activations (the default on
CPUs with bf16): scheduling, chunked prefill, prefix cache, session pins, preemption,
seeded sampling, aborts and fault isolation must all hold whatever the linear layers
compute with. A test's reference (the same prompt alone, uninterrupted) runs in int4 and
bf16 too, so "batched equals alone" also checks that a row's result does not depend on
what else is in the batch (the int4 kernel computes each row on its own)."""

import pytest

import tests.tiny
from tests.engine.test_async_engine import *  # noqa: F403
from tests.engine.test_engine import *  # noqa: F403
from tests.engine.test_faults import *  # noqa: F403
from tests.engine.test_session_pins import *  # noqa: F403


@pytest.fixture(autouse=True)
def _int4_weights(monkeypatch):
    monkeypatch.setattr(tests.tiny, "QUANTIZATION", "int4")
    monkeypatch.setattr(tests.tiny, "DTYPE", "bfloat16")


def test_the_engine_really_runs_int4(tokenizer):
    import torch

    from app.model.quant.int4 import Int4Linear

    engine = tests.tiny.tiny_engine(tokenizer)
    assert engine.weight_format.startswith("int4")
    assert isinstance(engine.model.layers[0].down, Int4Linear)
    assert engine.model.layers[0].down.dtype == torch.bfloat16
    assert engine.kv_cache.tensor.dtype == torch.bfloat16
