"""GGUF files made in the test, the way llama.cpp's converter makes them, load into a model
that computes what transformers computes on the original weights."""

import pytest
import torch

from app.config import ModelConfig, default_cache_dir
from app.model.build import build_model
from app.model.loader import load_model
from app.model.registry import default_model_path
from tests.model.gguf_export import write_llama_gguf
from tests.tiny import tiny_hf_llama3

pytest.importorskip("transformers")


def forward_all(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward_tokens(ids)


def test_llama3_rope_scaling_survives_gguf(tmp_path, tokenizer):
    hf = tiny_hf_llama3(len(tokenizer))
    path = write_llama_gguf(hf, tmp_path / "llama3.gguf", default_model_path(default_cache_dir()))
    cfg = ModelConfig(
        model=str(path), cache_dir=tmp_path / "cache", quantization="none", dtype="float32"
    )
    loaded = load_model(cfg)
    assert loaded.arch.rope_scaling is not None
    model = build_model(loaded, cfg, "cpu", 512).model
    ids = list(range(1000, 1300))  # long enough for every band to turn
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    diff = (forward_all(model, ids) - ref).abs().max().item()
    # fp32 rounding over 300 positions is ~1e-4 (as from an HF folder); without the
    # scaling the logits were ~19 apart.
    assert diff < 1e-3, f"max |logit difference| {diff}"
    # The scaling travels through the converted cache: a warm start computes the same.
    again = load_model(cfg)
    assert again.arch == loaded.arch
