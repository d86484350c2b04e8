"""The tiny-engine suites again, with int8 weights: scheduling, chunked prefill, prefix
cache, session pins, preemption, seeded sampling, aborts and fault isolation must all
hold whatever the linear layers compute with. A test's reference (the same prompt alone,
uninterrupted) is computed with int8 weights too, so "batched equals alone" also checks
that int8 results do not depend on what else is in the batch."""

import pytest

import tests.tiny
from tests.engine.test_async_engine import *  # noqa: F403
from tests.engine.test_engine import *  # noqa: F403
from tests.engine.test_faults import *  # noqa: F403
from tests.engine.test_session_pins import *  # noqa: F403


@pytest.fixture(autouse=True)
def _int8_weights(monkeypatch):
    monkeypatch.setattr(tests.tiny, "QUANTIZATION", "int8")


def test_the_engine_really_runs_int8(tokenizer):
    from app.model.quant.int8 import Int8Linear

    engine = tests.tiny.tiny_engine(tokenizer)
    assert engine.weight_format.startswith("int8")
    assert isinstance(engine.model.layers[0].down, Int8Linear)
    assert isinstance(engine.model.packed_lm_head, Int8Linear)
