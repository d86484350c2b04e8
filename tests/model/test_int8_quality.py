"""The quality gate of int8 weights on the default model (SmolLM2-135M-Instruct).

Two measures against fp32: perplexity on a fixed 2,000-token text written for the tests
(tests/data), and greedy agreement on 20 fixed chat prompts (the first 16 tokens). int8 may
become the default only if it passes both; today it passes the first and not the second
(see bench/README.md), so these tests hold the perplexity bound, keep the default on fp32
while agreement is short, and catch int8 getting worse than it is."""

import math
from pathlib import Path
from unittest import mock

import pytest
import torch

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.request import SamplingParams
from app.llm import LLM
from app.model import cpu
from app.model.build import build_model
from app.model.quant.int8 import Int8Linear, int8_available
from tests.model.test_int8 import forward_all

pytestmark = pytest.mark.skipif(not int8_available(), reason="PyTorch without fbgemm")

DATA = Path(__file__).parent.parent / "data"
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain continuous batching in two sentences.",
    "List three colors of the rainbow.",
    "What is the boiling point of water at sea level?",
    "Give me a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "Who wrote the play Romeo and Juliet?",
    "What is photosynthesis?",
    "Translate 'good morning' into Spanish.",
    "Name three planets in our solar system.",
    "What does HTTP stand for?",
    "Suggest a name for a pet goldfish.",
    "Why is the sky blue?",
    "What is 12 times 12?",
    "Describe a cat in one sentence.",
    "What are the benefits of regular exercise?",
    "How many days are in a leap year?",
    "Write a short greeting for a birthday card.",
    "What is the largest ocean on Earth?",
]
GATE_AGREEMENT = 15  # of 20 prompts, from the issue that introduced int8
# int8 reaches 10 here, but the count moves by +-3 with any last-bit change (an embedding
# kept in bf16 instead of fp32 gives 7 with a better perplexity): the floor only catches a
# broken int8 path; the perplexity bound catches the rest (a plain per-tensor conversion
# measured 1.77x).
FLOOR_AGREEMENT = 5


def gate_text(tokenizer) -> list[int]:
    text = (DATA / "lighthouses.txt").read_text() + "\n\n" + (DATA / "essays.txt").read_text()
    ids = tokenizer.encode(text)
    assert len(ids) >= 2000
    return ids


def perplexity(model, ids: list[int]) -> float:
    logits = forward_all(model, ids)[:-1].double()
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(-logp.mean().item())


@pytest.fixture(scope="module")
def models(smollm):
    fp32 = build_model(smollm, ModelConfig(quantization="none", dtype="float32"), "cpu", 4096)
    int8 = build_model(smollm, ModelConfig(quantization="int8", dtype="float32"), "cpu", 4096)
    return fp32.model, int8.model


# Perplexity bound by activation width. fbgemm's AVX2 kernel sums pairs of u8 x s8
# products in int16 (vpmaddubsw), which saturates on 8-bit activations: without VNNI they
# get 7 bits (Int8Linear), measured at +6.2% on an AVX2 EPYC against +2.2-2.5% with 8.
PERPLEXITY_BOUND = {255: 1.03, 127: 1.07}


@pytest.mark.parametrize("levels", [255, 127], ids=["8-bit x (VNNI)", "7-bit x (AVX2)"])
def test_int8_perplexity_is_within_its_bound_of_fp32(smollm, models, levels):
    """Each activation width the CPU may get, within its bound. 7 bits run on any CPU
    (faked here where VNNI exists); 8 bits only where VNNI does."""
    if levels == 255 and not cpu.cpu_has_vnni():
        pytest.skip("8-bit activations need VNNI: fbgemm's AVX2 kernel would saturate them")
    fp32_model, int8_model = models
    if (255 if cpu.cpu_has_vnni() else 127) != levels:
        with mock.patch.object(cpu, "cpu_has_vnni", lambda: levels == 255):
            int8_model = build_model(
                smollm, ModelConfig(quantization="int8", dtype="float32"), "cpu", 4096
            ).model
    widths = {m.x_zero_point for m in int8_model.modules() if isinstance(m, Int8Linear)}
    assert widths == {(levels + 1) // 2}  # every linear at this width
    ids = gate_text(smollm.tokenizer)
    fp32, int8 = perplexity(fp32_model, ids), perplexity(int8_model, ids)
    print(f"perplexity fp32 {fp32:.3f} int8 {int8:.3f} ratio {int8 / fp32:.4f} ({levels} levels)")
    assert int8 <= PERPLEXITY_BOUND[levels] * fp32


def greedy_16(smollm, quantization: str, dtype: str = "float32") -> list[list[int]]:
    config = EngineConfig(
        model=ModelConfig(quantization=quantization, dtype=dtype),
        cache=CacheConfig(256 << 20, enable_prefix_caching=False),
    )
    llm = LLM(config=config, loaded=smollm)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    return [c.token_ids for c in llm.chat(chats, SamplingParams(temperature=0, max_tokens=16))]


def test_greedy_agreement_decides_the_default(smollm):
    fp32, int8 = greedy_16(smollm, "none"), greedy_16(smollm, "int8")
    assert all(len(t) > 0 for t in fp32)
    agree = sum(a == b for a, b in zip(fp32, int8, strict=True))
    print(f"int8 agrees with fp32 on {agree} of {len(PROMPTS)} prompts (16 greedy tokens)")
    assert agree >= FLOOR_AGREEMENT
    if ModelConfig().quantization == "int8":
        assert agree >= GATE_AGREEMENT, "int8 is the default but fails the agreement gate"
