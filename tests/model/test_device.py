"""--device resolution and the weight format chosen for a GPU (no GPU needed: CUDA's
presence is monkeypatched; choose_format only reads the device's type)."""

import pytest
import torch

from app.config import ModelConfig
from app.model.build import choose_format
from app.model.device import resolve_device
from tests.tiny import tiny_loaded


class Tok:
    """Enough of a tokenizer for tiny_loaded."""

    eos_token_id = 0

    def __len__(self) -> int:
        return 64


@pytest.mark.parametrize("present", [True, False])
def test_auto_is_cuda_exactly_when_torch_sees_a_gpu(monkeypatch, present):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: present)
    assert resolve_device("auto").type == ("cuda" if present else "cpu")


def test_cpu_stays_cpu_and_a_missing_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="not a device"):
        resolve_device("gpu0")


def test_auto_on_cuda_is_bf16_with_weights_as_loaded():
    loaded = tiny_loaded(Tok())
    loaded.tensor_types = {"model.layers.0.self_attn.q_proj.weight": "Q4_1"}  # int4 on a CPU
    fmt = choose_format(ModelConfig(), loaded, "cuda")
    assert (fmt.quantization, fmt.dtype) == ("none", "bfloat16")
    assert "CPU ones" in fmt.why
    assert choose_format(ModelConfig(dtype="float32"), loaded, "cuda:0").dtype == "float32"


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_cpu_kernels_are_refused_on_cuda(quantization):
    cfg = ModelConfig(quantization=quantization, dtype="float32")
    with pytest.raises(ValueError, match="need the CPU"):
        choose_format(cfg, tiny_loaded(Tok()), "cuda")
