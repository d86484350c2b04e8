"""The families beyond Llama's decoder (app/model/families), each a small random model built
in the test and written as llama.cpp writes it: our GGUF reader and layers compute what
transformers computes on the same weights. And an architecture we do not run is a one-line
error that names those we do."""

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from app.config import ModelConfig, default_cache_dir
from app.model.build import build_model
from app.model.loader import load_model
from app.model.registry import SUPPORTED_ARCHITECTURES, default_model_path
from tests.model.gguf_families import tiny_hf, write_family_gguf

pytest.importorskip("transformers")


def exact(path, tmp_path, **kw) -> ModelConfig:
    return ModelConfig(
        model=str(path), cache_dir=tmp_path / "cache", quantization="none", dtype="float32", **kw
    )


@pytest.mark.parametrize(
    ("family", "kernels"), [("qwen3", "off"), ("gemma3", "off"), ("gemma3", "on"), ("phi3", "off")]
)
def test_a_family_computes_what_transformers_computes(family, kernels, tmp_path, tokenizer):
    """With Parley's CPU kernels on, Gemma's local layers attend through paged_prefill's
    window (where the CPU has AVX-512; PyTorch's SDPA otherwise)."""
    hf = tiny_hf(family, len(tokenizer))
    path = write_family_gguf(
        hf, tmp_path / f"{family}.gguf", default_model_path(default_cache_dir())
    )
    cfg = exact(path, tmp_path, cpu_kernels=kernels)
    loaded = load_model(cfg)
    assert loaded.arch.architecture == family and loaded.arch.qk_norm == (family != "phi3")
    if family == "gemma3":  # 5 local layers of 8 positions, then a global one
        assert [loaded.arch.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    model = build_model(loaded, cfg, "cpu", 512).model
    ids = list(range(1000, 1040))  # 40 positions: 5 windows' worth
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        ours = model.forward_tokens(ids)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-3, f"max |logit difference| {diff}"


def test_gemma3_without_its_window_would_differ(tmp_path, tokenizer):
    """The test above can fail: attending to everything in the local layers moves the
    logits of positions past the window."""
    hf = tiny_hf("gemma3", len(tokenizer))
    path = write_family_gguf(hf, tmp_path / "g.gguf", default_model_path(default_cache_dir()))
    cfg = exact(path, tmp_path)
    model = build_model(load_model(cfg), cfg, "cpu", 512).model
    ids = list(range(1000, 1040))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        for layer in model.layers:
            layer.window = None
        wrong = model.forward_tokens(ids)
    assert (wrong[8:] - ref[8:]).abs().max().item() > 1e-2


def test_an_unknown_architecture_is_one_line_naming_the_supported(tmp_path):
    path = tmp_path / "bogus.gguf"
    writer = GGUFWriter(str(path), "bogus")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as err:
        load_model(ModelConfig(model=str(path), cache_dir=tmp_path / "cache"))
    message = str(err.value)
    assert "\n" not in message and "'bogus'" in message
    assert all(a in message for a in SUPPORTED_ARCHITECTURES)


def test_known_model_names_and_paths(tmp_path):
    from app.model.registry import GEMMA3_270M, known_model

    assert known_model("Gemma-3-270M") is GEMMA3_270M
    assert known_model("no-such-model") is None
    with pytest.raises(FileNotFoundError, match="known model name"):
        load_model(ModelConfig(model=str(tmp_path / "missing.gguf"), cache_dir=tmp_path))


def test_gemma3_template_has_no_system_role(tokenizer):
    """A Gemma file without a template of its own gets Gemma's turns; a system message
    opens the first user turn (Gemma has no system role)."""
    from app.model.families.gemma3 import CHAT_TEMPLATE

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Why?"},
    ]
    text = tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    bos = tokenizer.bos_token or ""
    assert text == (
        f"{bos}<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize("family,kind", [("qwen3", "Q5_0"), ("phi3", "Q8_0"), ("gemma3", "Q5_1")])
def test_quantized_linears_run_as_stored(family, kind, tmp_path, tokenizer):
    """A file's 5- and 8-bit linears serve from their own blocks (on group_matmul, Phi-3's
    fused matrices whole): the same function as the exact reference, which dequantizes the
    same blocks, but for the kernel's bf16 activations (x rounded to bf16 on the way in, as
    q4_matmul's are, where the model's own activations are fp32)."""
    from app.model.quant.kquants import GroupLinear

    hf = tiny_hf(family, len(tokenizer))
    source = default_model_path(default_cache_dir())
    path = write_family_gguf(hf, tmp_path / "q.gguf", source, GGMLQuantizationType[kind])
    ref_cfg = exact(path, tmp_path)
    loaded = load_model(ref_cfg)
    assert loaded.linear_types() == {kind}
    ref = build_model(loaded, ref_cfg, "cpu", 512).model
    cfg = exact(path, tmp_path)
    cfg = ModelConfig(**{**cfg.__dict__, "quantization": "auto", "cpu_kernels": "on"})
    built = build_model(loaded, cfg, "cpu", 512)
    assert built.format.quantization == "int4"
    linears = [m for m in built.model.modules() if isinstance(m, GroupLinear)]
    assert len(linears) == 4 * loaded.arch.num_layers and all(m.kernel for m in linears)
    ids = list(range(1000, 1040))
    with torch.no_grad():
        want, got = ref.forward_tokens(ids), built.model.forward_tokens(ids)
    # Activations in bf16 (2^-9 relative) through every layer of a random model: ~1%; a
    # weight read wrong (a code, a scale, a layout) is off by its whole size.
    diff = ((got - want).abs().max() / want.abs().max()).item()
    assert diff < 0.03, f"max |logit difference| / max |logit| {diff} ({built.format.dtype})"


@pytest.mark.parametrize("family,kind", [("gemma3", "Q5_1"), ("gemma3", "Q8_0"), ("qwen3", "Q4_0")])
def test_the_families_layer_stack_in_one_call_equals_layer_by_layer(
    family, kind, tmp_path, tokenizer, monkeypatch
):
    """Decode steps through decode_layers_normed (one C++ call for all layers: q/k norms,
    Gemma's sandwich norms, GELU and local windows; group_matmul with and without offsets,
    q4_matmul) give the same bits as the family's Python layers with the same kernels, past
    the local window (8 positions) and in a batch of two."""
    from app.config import CacheConfig, EngineConfig
    from app.engine.engine import LLMEngine
    from app.engine.engine_request import EngineRequest
    from app.engine.request import SamplingParams
    from app.model.llama import FusedCpuOps

    hf = tiny_hf(family, len(tokenizer))
    source = default_model_path(default_cache_dir())
    path = write_family_gguf(hf, tmp_path / "q.gguf", source, GGMLQuantizationType[kind])
    model_cfg = ModelConfig(model=str(path), cache_dir=tmp_path / "cache", cpu_kernels="on")
    loaded = load_model(model_cfg)
    config = EngineConfig(model=model_cfg, cache=CacheConfig(16 << 20))
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3, ignore_eos=True)
    prompts = [list(range(1000, 1005)), list(range(2000, 2011))]
    calls, runs = [], []
    for stacked in (True, False):
        engine = LLMEngine(config, loaded)
        assert isinstance(engine.model.ops, FusedCpuOps)
        one_call = FusedCpuOps.decode_normed_layers

        def spy(self, *args, _real=one_call, _on=stacked):
            out = _real(self, *args) if _on else None
            calls.append(out is not None)
            return out

        monkeypatch.setattr(FusedCpuOps, "decode_normed_layers", spy)
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(p, params, f"r{i}"))
        got: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(
                    (lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or []
                )
        runs.append(got)
        engine.close()
        monkeypatch.undo()
    assert any(calls) and not all(calls)  # the one-call path ran, and so did the layers
    assert len(runs[0]["r0"]) == 20 and runs[0] == runs[1]
