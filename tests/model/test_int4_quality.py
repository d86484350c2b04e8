"""The quality gate of int4 weights, which "auto" serves for the default model
(SmolLM2-135M-Instruct, a Q4_1 GGUF). Against the fp32 reference (the same GGUF
dequantized, run in fp32): perplexity on the test text within 1%, and the first 16 greedy
tokens of 20 fixed chat prompts equal on at least 15 (issue 12). Both activation dtypes
that "auto" can pick are held to it, whichever this CPU picks."""

import pytest

from app.config import ModelConfig
from app.model.build import build_model, choose_format
from app.model.quant.int4 import int4_available
from tests.model.test_int8_quality import GATE_AGREEMENT, PROMPTS, gate_text, greedy_16, perplexity

pytestmark = pytest.mark.skipif(not int4_available(), reason="PyTorch without the int4 kernel")

GATE_PERPLEXITY = 1.01


def test_the_default_model_is_served_in_int4(smollm):
    fmt = choose_format(ModelConfig(), smollm, "cpu")
    assert fmt.quantization == "int4" and fmt.dtype in ("bfloat16", "float32")


@pytest.fixture(scope="module")
def reference(smollm):
    fp32 = build_model(smollm, ModelConfig(quantization="none", dtype="float32"), "cpu", 4096)
    return perplexity(fp32.model, gate_text(smollm.tokenizer)), greedy_16(smollm, "none")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int4_passes_the_quality_gate(smollm, reference, dtype):
    ref_ppl, ref_greedy = reference
    int4 = build_model(smollm, ModelConfig(quantization="int4", dtype=dtype), "cpu", 4096)
    ppl = perplexity(int4.model, gate_text(smollm.tokenizer))
    agree = sum(a == b for a, b in zip(ref_greedy, greedy_16(smollm, "int4", dtype), strict=True))
    print(f"int4 {dtype}: perplexity {ppl:.3f} vs {ref_ppl:.3f} ({ppl / ref_ppl:.4f}x), "
          f"{agree} of {len(PROMPTS)} prompts agree")  # fmt: skip
    assert ppl <= GATE_PERPLEXITY * ref_ppl
    assert agree >= GATE_AGREEMENT
