"""int8 weights (app.model.quant.int8): the layer, smoothing, and the disk cache."""

import pytest
import torch
import torch.nn.functional as F

from app.config import ModelConfig
from app.model import build as build_mod
from app.model.build import build_model
from app.model.llama import LlamaModel
from app.model.quant.int8 import (
    Int8Linear,
    calibrate,
    int8_available,
    model_from_quantized,
    quantize_model,
    quantized_state_dict,
    smooth,
)
from tests.tiny import tiny_loaded

pytestmark = pytest.mark.skipif(not int8_available(), reason="PyTorch without fbgemm")


def forward_all(model, ids):
    with torch.inference_mode():
        return model.forward_tokens(ids)


def test_int8_linear_is_close_to_fp32():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(5, 64, generator=g)
    x[2] *= 100  # rows of very different scales each keep their precision
    want = F.linear(x, w, b)
    got = Int8Linear.from_float(w, b)(x)
    rel = (got - want).norm(dim=1) / want.norm(dim=1)
    assert rel.max() < 0.02, rel


def test_a_rows_result_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(1)
    layer = Int8Linear.from_float(torch.randn(32, 48, generator=g), None)
    row = torch.randn(1, 48, generator=g)
    alone = layer(row)
    for others in (torch.randn(7, 48, generator=g) * 1000, torch.zeros(3, 48)):
        together = layer(torch.cat((others, row)))[-1:]
        assert torch.equal(together, alone)


def test_smoothing_keeps_the_fp32_function(tokenizer):
    loaded = tiny_loaded(tokenizer)
    model = LlamaModel.from_weights(loaded.arch, loaded.weights, 256)
    ids = tokenizer.encode("Lighthouses guided ships along dangerous coasts for centuries.")
    # Outlier channels, as real models have them, so that smoothing has work to do.
    with torch.no_grad():
        model.layers[0].input_norm.weight[3] *= 50
    before = forward_all(model, ids)
    norm = model.layers[0].input_norm.weight.clone()
    smooth(model, calibrate(model, ids))
    assert (model.layers[0].input_norm.weight - norm).abs().max() > 1  # it moved the outlier
    torch.testing.assert_close(forward_all(model, ids), before, rtol=1e-4, atol=1e-4)


def test_quantized_model_tracks_fp32_and_survives_a_round_trip(tokenizer):
    loaded = tiny_loaded(tokenizer)
    ids = tokenizer.encode("Quantization trades a little precision for a lot of speed.")
    fp32 = forward_all(LlamaModel.from_weights(loaded.arch, dict(loaded.weights), 256), ids)
    weights = {k: v.clone() for k, v in loaded.weights.items()}
    q = quantize_model(LlamaModel.from_weights(loaded.arch, weights, 256), tokenizer)
    logits = forward_all(q, ids)
    agree = (logits.argmax(-1) == fp32.argmax(-1)).float().mean()
    assert agree >= 0.9, agree
    state = quantized_state_dict(q)
    assert state["layers.0.qkv.qweight"].dtype == torch.int8
    assert not any(v.dtype == torch.float32 and v.dim() == 2 and "layers" in k
                   for k, v in state.items())  # fmt: skip
    rebuilt = model_from_quantized(loaded.arch, state, 256)
    assert torch.equal(forward_all(rebuilt, ids), logits)


def test_int8_weights_are_cached_on_disk_and_reused(tokenizer, tmp_path, monkeypatch):
    loaded = tiny_loaded(tokenizer)
    loaded.cache_key = "tiny-test"
    cfg = ModelConfig(quantization="int8", cache_dir=tmp_path)
    ids = tokenizer.encode("A warm start maps the converted file.")
    first = build_model(loaded, cfg, "cpu", 256).model
    assert isinstance(first.layers[0].qkv, Int8Linear)
    files = list((tmp_path / "converted").glob("tiny-test-int8-*/model.safetensors"))
    assert len(files) == 1

    def no_requantizing(*a, **k):
        raise AssertionError("a warm start must not quantize again")

    monkeypatch.setattr(build_mod, "quantize_model", no_requantizing)
    second = build_model(loaded, cfg, "cpu", 256).model
    assert torch.equal(forward_all(second, ids), forward_all(first, ids))


@pytest.mark.parametrize(
    ("cfg", "device", "message"),
    [
        (ModelConfig(quantization="int8", dtype="bfloat16"), "cpu", "float32"),
        (ModelConfig(quantization="int8"), "meta", "CPU"),
    ],
)
def test_int8_where_it_cannot_run_is_a_clear_error(tokenizer, cfg, device, message):
    with pytest.raises(ValueError, match=message):
        build_model(tiny_loaded(tokenizer), cfg, device, 256)


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="none, int8, int4"):
        ModelConfig(quantization="int2")
