"""The tiny-engine suites again on CUDA: batched = alone, chunked prefill, prefix cache,
session pins, preemption, seeded sampling, aborts, fault isolation. fp32, so greedy
tokens compare exactly with each prompt alone on the same device; CUDA graphs and
FlexAttention decode are on, as they are by default there."""

import pytest

import tests.tiny
from app.engine.request import SamplingParams
from app.model.attention_backends import FlexBackend, SdpaBackend
from tests.engine.test_async_engine import *  # noqa: F403
from tests.engine.test_engine import *  # noqa: F403
from tests.engine.test_engine import generate, prompts
from tests.engine.test_faults import *  # noqa: F403
from tests.engine.test_session_pins import *  # noqa: F403


@pytest.fixture(autouse=True)
def _on_cuda(monkeypatch):
    monkeypatch.setattr(tests.tiny, "DEVICE", "cuda")


def test_the_engine_really_runs_on_cuda(tokenizer):
    engine = tests.tiny.tiny_engine(tokenizer)
    assert engine.kv_cache.tensor.device.type == "cuda"
    assert engine.model.embed_tokens.weight.device.type == "cuda"
    attention = engine.runner.attention
    assert isinstance(attention, FlexBackend), "FlexAttention decode did not compile here"
    assert engine.runner.graphs is not None


def test_graphs_and_flex_give_the_eager_gathered_tokens(tokenizer, monkeypatch):
    """Decode through replayed graphs (buckets of 1..16 rows, padded) equals decode through
    the gathered-K/V path, token for token, including when batch sizes shrink."""
    ps = prompts(11)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = tests.tiny.tiny_engine(tokenizer)
    got = generate(engine, ps, params, stagger=2)
    assert len(engine.runner.graphs.graphs) >= 3  # several buckets were captured
    eager = tests.tiny.tiny_engine(tokenizer)
    eager.runner.graphs = None
    a = eager.runner.attention  # the CPU's gather + SDPA path, on the GPU
    eager.runner.attention = SdpaBackend(a.block_size, a.query_groups, a.dtype)
    want = generate(eager, ps, params, stagger=2)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
