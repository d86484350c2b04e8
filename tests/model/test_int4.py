"""int4 weights (app.model.quant.int4): GGUF Q4 blocks as they are, the kernel layout, the
model built from them, the disk cache, and the choice that "auto" makes."""

import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from gguf.quants import dequantize, quantize

from app.config import ModelConfig, default_cache_dir
from app.model import build as build_mod
from app.model import cpu
from app.model.build import build_model, choose_format
from app.model.gguf_file import iter_q4_weights, open_gguf
from app.model.loader import load_model
from app.model.quant.int4 import (
    GROUP,
    Int4Linear,
    Int4Weight,
    from_gguf_q4,
    int4_available,
    int4_linears,
    model_from_int4,
    quantize_rtn,
)
from app.model.registry import default_model_path
from tests.model.gguf_export import write_llama_gguf
from tests.tiny import tiny_hf_llama3, tiny_loaded

pytestmark = pytest.mark.skipif(not int4_available(), reason="PyTorch without the int4 kernel")


def forward_all(model, ids):
    with torch.inference_mode():
        return model.forward_tokens(ids)


def nibbles(raw: np.ndarray, kind: str) -> np.ndarray:
    """The 4-bit codes of GGUF Q4 blocks, read straight from llama.cpp's block layout:
    after the header, byte j of a block holds weight j (low) and weight j + 16 (high)."""
    head = {"Q4_0": 2, "Q4_1": 4}[kind]
    blocks = raw.reshape(raw.shape[0], -1, head + 16)[..., head:]
    return np.concatenate((blocks & 15, blocks >> 4), axis=-1).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_are_served_bit_for_bit(kind):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) * torch.rand(96, 1, generator=g)
    raw = quantize(w.numpy(), GGML[kind])
    want = torch.from_numpy(dequantize(raw, GGML[kind]))
    weight = from_gguf_q4(raw, kind)
    assert np.array_equal(weight.unpacked().numpy(), nibbles(raw, kind))  # the same codes
    assert torch.equal(weight.dequantize(), want)
    # Through the kernel with fp32 activations: one product per output, rounded once, so
    # multiplying by the identity gives the GGUF's dequantized weights exactly.
    exact = Int4Linear(weight, None, torch.float32)(torch.eye(128))
    assert torch.equal(exact.t(), want)
    # And the packed codes themselves, read back through the kernel (scale 1, zero 8: w = q).
    probe = Int4Weight(weight.codes, torch.ones_like(weight.scale), torch.zeros_like(weight.offset))
    codes = Int4Linear(probe, None, torch.bfloat16)(torch.eye(128, dtype=torch.bfloat16))
    assert np.array_equal(codes.t().to(torch.uint8).numpy(), nibbles(raw, kind))


@pytest.fixture(scope="module")
def parley_kernels():
    from app.model import kernels

    why = kernels.load(default_cache_dir())
    if why is not None:
        pytest.skip(why)


@pytest.fixture(params=["amx", "vector"])
def q4_path(request, parley_kernels):
    """Each of q4_matmul's paths this machine can run: AMX's tile units (where the CPU has
    them and the OS grants their state) and the vector path (vdpbf16ps, AVX2 or portable),
    which a process without AMX, or with PARLEY_AMX=0, runs."""
    amx = torch.ops.parley.q4_amx()
    if request.param == "amx" and not amx:
        pytest.skip("no AMX here (or the OS has not granted its tile state)")
    torch.ops.parley.q4_amx(request.param == "amx")
    try:
        assert ("AMX" in torch.ops.parley.q4_path()) == (request.param == "amx")
        yield request.param
    finally:
        torch.ops.parley.q4_amx(amx)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_parleys_kernel_serves_the_gguf_weights_exactly(kind, q4_path):
    """Through Parley's q4_matmul: the file's fp16 scales as they are (PyTorch's kernel
    rounds them to bf16), so a one-hot row reads back the dequantized weights exactly."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 128, generator=g) * torch.rand(96, 1, generator=g)
    raw = quantize(w.numpy(), GGML[kind])
    want = torch.from_numpy(dequantize(raw, GGML[kind]))
    layer = Int4Linear(from_gguf_q4(raw, kind), None, torch.bfloat16, "parley")
    eye = torch.eye(128, dtype=torch.bfloat16)
    got = torch.ops.parley.q4_matmul(eye, layer.codes, layer.d, layer.m, torch.float32)
    assert torch.equal(got.t(), want)


@pytest.mark.parametrize("shape", [(80, 576), (112, 1536)])
def test_parleys_kernel_gives_a_row_the_same_bits_in_any_batch_and_thread_count(shape, q4_path):
    """One arithmetic for one row and for hundreds: a decode's row, a prompt's and a chunk's
    come out alike, on one thread or several (and close to the exact product), on each path.
    From 32 rows the kernel reads weights it unpacked for the call, in slabs of tiles (3
    tiles of 1,536 columns a slab: the second shape spans three slabs); fewer rows read the
    codes. AMX takes rows in blocks of 16 and 32 (17 and 36 rows: a short second block)."""
    g = torch.Generator().manual_seed(5)
    weight = quantize_rtn(torch.randn(*shape, generator=g))
    layer = Int4Linear(weight, None, torch.bfloat16, "parley")
    x = torch.randn(45, shape[1], generator=g).bfloat16()
    whole = layer(x.float())
    exact = x.double() @ weight.dequantize().double().t()
    assert ((whole.double() - exact).norm() / exact.norm()) < 1e-6
    for i in (0, 7, 8, 44):
        assert torch.equal(layer(x[i : i + 1].float()), whole[i : i + 1]), i
    assert torch.equal(layer(x[3:20].float()), whole[3:20])
    assert torch.equal(layer(x[2:38].float()), whole[2:38])  # 36 rows: unpacked too
    assert torch.equal(layer(x[1:17].float()), whole[1:17])
    assert torch.equal(layer(x), whole.bfloat16())  # bf16 out: the fp32 sum rounded once
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(layer(x.float()), whole), n
    finally:
        torch.set_num_threads(threads)


def test_a_process_told_not_to_use_amx_runs_the_vector_path(tmp_path, parley_kernels):
    """PARLEY_AMX=0 (as on a CPU that reports AMX whose OS has not granted the tile state:
    the kernel asks the OS before its first tile instruction) runs the vector path, with its
    bits; where the OS grants it, the default is AMX, with its own."""
    g = torch.Generator().manual_seed(8)
    weight = quantize_rtn(torch.randn(48, 128, generator=g))
    layer = Int4Linear(weight, None, torch.bfloat16, "parley")
    x = torch.randn(5, 128, generator=g).bfloat16()
    torch.save({"codes": layer.codes, "d": layer.d, "m": layer.m, "x": x}, tmp_path / "in.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from pathlib import Path
        from app.model import kernels
        assert kernels.load(Path({str(default_cache_dir())!r})) is None
        a = torch.load({str(tmp_path / "in.pt")!r})
        y = torch.ops.parley.q4_matmul(a["x"], a["codes"], a["d"], a["m"], torch.float32)
        torch.save((torch.ops.parley.q4_path(), y), {str(tmp_path / "out.pt")!r})
        """
    )
    env = {**os.environ, "PARLEY_AMX": "0"}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600, env=env)
    path, y = torch.load(tmp_path / "out.pt")
    assert "AMX" not in path
    amx = torch.ops.parley.q4_amx()
    try:
        torch.ops.parley.q4_amx(False)
        assert torch.equal(y, torch.ops.parley.q4_matmul(x, layer.codes, layer.d, layer.m,
                                                         torch.float32))  # fmt: skip
    finally:
        torch.ops.parley.q4_amx(amx)
    assert ("AMX" in torch.ops.parley.q4_path()) == amx


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_the_kernels_group_sums_add_each_groups_inputs_in_order(rows, q4_path):
    """The zero-point term m_b * sum(x of group b) takes each group's sum in order in fp32
    (x[32b] first), however many groups are summed at once (16 at a time on AVX-512, the
    rest one by one). With every scale 0 and every zero 1 the output is exactly those sums
    added in order; inputs of very different sizes make any other order round apart."""
    g = torch.Generator().manual_seed(6)
    k = 96
    probe = Int4Weight(
        Int4Weight.pack_codes(torch.zeros(16, k, dtype=torch.uint8)),
        torch.zeros(16, k // GROUP),
        torch.ones(16, k // GROUP),
    )
    layer = Int4Linear(probe, None, torch.bfloat16, "parley")
    x = torch.randn(rows, k, generator=g) * 10.0 ** torch.randint(-4, 5, (rows, k), generator=g)
    x = x.bfloat16()
    want = np.zeros(rows, dtype=np.float32)
    for r in range(rows):
        for b in range(k // GROUP):
            s = np.float32(0)
            for v in x[r, b * GROUP : (b + 1) * GROUP].float().numpy():
                s = np.float32(s + v)
            want[r] = np.float32(want[r] + s)
    got = torch.ops.parley.q4_matmul(x, layer.codes, layer.d, layer.m, torch.float32)
    assert np.array_equal(got[:, 0].numpy(), want)
    assert torch.equal(got, got[:, :1].expand(-1, 16))


def test_bf16_activations_differ_only_by_bf16_rounding():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 256, generator=g), torch.randn(5, 256, generator=g)
    weight = quantize_rtn(w)
    want = x @ weight.dequantize().t()
    got = Int4Linear(weight, None, torch.bfloat16)(x)
    assert got.dtype == torch.float32
    rel = (got - want).norm() / want.norm()
    assert 1e-4 < rel < 1e-2, rel  # bf16 rounding of x, scales and output: ~0.3%


def test_rounding_floats_stays_within_half_a_step():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 96, generator=g)
    w[3, :GROUP] = 0.5  # a constant group: zero range, exact
    q = quantize_rtn(w)
    step = q.scale.repeat_interleave(GROUP, dim=1)
    err = (q.dequantize() - w).abs()
    assert (err <= step / 2 + 1e-6).all()
    assert torch.equal(q.dequantize()[3, :GROUP], w[3, :GROUP])


def test_a_rows_result_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(3)
    layer = Int4Linear(quantize_rtn(torch.randn(48, 64, generator=g)), None, torch.bfloat16)
    row = torch.randn(1, 64, generator=g)
    alone = layer(row)
    for others in (torch.randn(7, 64, generator=g) * 1000, torch.zeros(30, 64)):
        assert torch.equal(layer(torch.cat((others, row)))[-1:], alone)


def write_q4_gguf(folder, tokenizer, overrides: dict) -> object:
    """A tiny Llama 3 as llama.cpp quantizes it: linears Q4_1 (with `overrides`), a Q8_0
    embedding."""
    return write_llama_gguf(
        tiny_hf_llama3(len(tokenizer)),
        folder / "tiny-q4.gguf",
        default_model_path(default_cache_dir()),
        linear_type=GGML.Q4_1,
        embedding_type=GGML.Q8_0,
        overrides=overrides,
    )


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory, tokenizer):
    """Every linear 4-bit: Q4_1, and Q4_0 for the V projections."""
    return write_q4_gguf(tmp_path_factory.mktemp("q4"), tokenizer, {"attn_v": GGML.Q4_0})


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, tokenizer):
    """The MLP's down projections in Q8_0: not 4-bit, so we round them."""
    return write_q4_gguf(tmp_path_factory.mktemp("mixed"), tokenizer, {"ffn_down": GGML.Q8_0})


def test_int4_model_computes_what_the_dequantized_gguf_does(q4_gguf, tmp_path):
    cfg = ModelConfig(model=str(q4_gguf), cache_dir=tmp_path, quantization="none", dtype="float32")
    loaded = load_model(cfg)
    assert loaded.linear_types() == {"Q4_0", "Q4_1"}
    reference = build_model(loaded, cfg, "cpu", 512)  # fp32, dequantized by gguf
    ids = list(range(2000, 2100))
    want = forward_all(reference.model, ids)

    # The kernel in fp32: the same weights exactly (Q/K rows unpermuted, q, k, v stacked in
    # order), so only the order of accumulation differs.
    reader, arch = open_gguf(q4_gguf)
    linears, as_stored = int4_linears(arch, loaded.weights, dict(iter_q4_weights(reader, arch)))
    assert as_stored == 7 * arch.num_layers
    exact = model_from_int4(arch, loaded.weights, linears, torch.float32, 512, torch.float32)
    diff = (forward_all(exact, ids) - want).abs().max().item()
    assert diff < 1e-3, diff

    # As served: bf16 matmuls, with fp32 or bf16 activations around them. What bf16
    # itself costs (this random model amplifies it to ~3% of the logits), no more.
    def error(model) -> float:
        return ((forward_all(model, ids) - want).norm() / want.norm()).item()

    bf16 = error(build_model(loaded, replace(cfg, dtype="bfloat16"), "cpu", 512).model)
    for dtype in ("float32", "bfloat16"):
        served = build_model(loaded, replace(cfg, quantization="int4", dtype=dtype), "cpu", 512)
        assert isinstance(served.model.layers[1].qkv, Int4Linear)
        assert served.weight_bytes < reference.weight_bytes
        assert error(served.model) < 1.25 * bf16 + 1e-3, dtype


def test_weights_in_other_formats_are_served_as_stored(mixed_gguf, tmp_path, caplog):
    """Q8_0 linears beside Q4_1 ones run from their own bytes (int8 codes on group_matmul),
    not rounded to 4 bits (which moved this random model's logits by ~13%)."""
    cfg = ModelConfig(
        model=str(mixed_gguf), cache_dir=tmp_path, quantization="none", dtype="float32"
    )
    loaded = load_model(cfg)
    assert loaded.linear_types() == {"Q4_1", "Q8_0"}
    with caplog.at_level("INFO"):
        int4 = build_model(loaded, replace(cfg, quantization="int4"), "cpu", 512)
    assert "14 of 14 linear weights as the checkpoint stores them" in caplog.text
    ids = list(range(2000, 2100))
    want = forward_all(build_model(loaded, cfg, "cpu", 512).model, ids)
    got = forward_all(int4.model, ids)
    # What remains is the bf16 inputs of the 4-bit kernel's matmuls (a wrong row order
    # would move them by ~140%).
    assert (got - want).norm() / want.norm() < 0.05


def test_int4_codes_are_cached_and_a_warm_start_reads_no_gguf(q4_gguf, tmp_path, monkeypatch):
    cfg = ModelConfig(model=str(q4_gguf), cache_dir=tmp_path, quantization="int4")
    loaded = load_model(cfg)
    ids = list(range(100, 140))
    first = forward_all(build_model(loaded, cfg, "cpu", 512).model, ids)
    assert (
        len(list((tmp_path / "converted").glob(f"*-{build_mod.INT4_FORMAT}/model.safetensors")))
        == 1
    )

    def no_rebuilding(*a, **k):
        raise AssertionError("a warm start must not read the GGUF or round weights again")

    monkeypatch.setattr(build_mod, "int4_linears", no_rebuilding)
    second = forward_all(build_model(loaded, cfg, "cpu", 512).model, ids)
    assert torch.equal(first, second)


def test_hf_folder_weights_are_rounded_to_int4(tokenizer):
    loaded = tiny_loaded(tokenizer)  # floats, no cache key
    ids = tokenizer.encode("Four bits a weight, thirty-two weights a scale.")
    cfg = ModelConfig(quantization="none", dtype="float32")
    want = forward_all(build_model(loaded, cfg, "cpu", 256).model, ids)
    int4 = build_model(loaded, ModelConfig(quantization="int4", dtype="float32"), "cpu", 256)
    got = forward_all(int4.model, ids)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


# -- what "auto" chooses ------------------------------------------------------------------


AUTO = ModelConfig(quantization="auto", dtype="auto")


def fake_cpu(monkeypatch, bf16: bool) -> None:
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: bf16)


def pick(cfg: ModelConfig, loaded, device: str = "cpu") -> tuple[str, str]:
    fmt = choose_format(cfg, loaded, device)
    return fmt.quantization, fmt.dtype


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_serves_4bit_checkpoints_in_int4(tokenizer, monkeypatch, bf16):
    fake_cpu(monkeypatch, bf16)
    loaded = tiny_loaded(tokenizer)
    loaded.tensor_types = {"model.layers.0.self_attn.q_proj.weight": "Q4_1"}
    fmt = choose_format(AUTO, loaded, "cpu")
    assert (fmt.quantization, fmt.dtype) == ("int4", "bfloat16" if bf16 else "float32")
    assert "Q4_1" in fmt.why
    assert ("this CPU has native bf16" in fmt.why) == bf16
    assert fmt.describe().startswith("int4 weights (groups of 32")


def test_the_start_up_line_names_the_gguf_types_served_as_stored(tokenizer, monkeypatch):
    """A Q4_K_M file's linears are not int4 in groups of 32: the engine's start-up line says
    which types run as stored, and how."""
    fake_cpu(monkeypatch, True)
    loaded = tiny_loaded(tokenizer)
    loaded.tensor_types = {
        "model.layers.0.self_attn.q_proj.weight": "Q5_0",
        "model.layers.0.mlp.down_proj.weight": "Q6_K",
        "model.layers.0.mlp.up_proj.weight": "Q4_K",
    }
    fmt = choose_format(AUTO, loaded, "cpu")
    assert fmt.stored == ("Q4_K", "Q5_0", "Q6_K")
    assert fmt.describe().startswith("GGUF weights as stored (Q4_K/Q5_0/Q6_K: ")
    assert "groups of 32" not in fmt.describe()
    # A float checkpoint rounded to int4 here has no stored types: groups of 32.
    loaded.tensor_types = {"model.layers.0.mlp.down_proj.weight": "F16"}
    fmt = choose_format(ModelConfig(quantization="int4", dtype="auto"), loaded, "cpu")
    assert fmt.stored == () and fmt.describe().startswith("int4 weights (groups of 32")


def test_the_start_up_log_names_each_types_kernel_and_how_it_is_held(tokenizer, parley_kernels):
    from torch import nn

    from app.model.build import _kernels_by_type, group_layouts
    from app.model.quant.kquants import GroupLinear, GroupWeight

    loaded = tiny_loaded(tokenizer)
    loaded.tensor_types = {
        "model.layers.0.self_attn.q_proj.weight": "Q5_0",
        "model.layers.0.mlp.down_proj.weight": "Q6_K",
        "model.layers.0.mlp.up_proj.weight": "Q4_1",
    }
    line = _kernels_by_type(loaded, "parley")
    path = torch.ops.parley.group_path()  # the vector path this CPU runs (never AMX)
    assert "AMX" not in path
    assert f"Q5_0 on Parley's group_matmul ({path})" in line
    assert f"Q6_K on Parley's group_matmul ({path})" in line
    assert "Q4_1 on Parley's q4_matmul" in line
    # What is held is read off the weights themselves: the bits their codes need, and fp16
    # scales where every scale is an fp16 value.
    g = torch.Generator().manual_seed(0)

    def linear(lo: int, hi: int, half: bool) -> GroupLinear:
        scale = torch.rand(32, 2, generator=g)
        codes = torch.randint(lo, hi, (32, 64), generator=g).to(torch.int8)
        return GroupLinear(GroupWeight(codes, scale.half().float() if half else scale, None, 32))

    model = nn.ModuleList([linear(-16, 16, True), linear(-16, 16, True), linear(-32, 32, False)])
    held = group_layouts(model)
    assert held == "2 at 5-bit codes with float16 scales, 1 at 6-bit codes with float32 scales"


def test_auto_keeps_float_checkpoints_as_they_are(tokenizer, monkeypatch):
    fake_cpu(monkeypatch, True)
    loaded = tiny_loaded(tokenizer)
    assert pick(AUTO, loaded) == ("none", "float32")
    loaded.tensor_types = {"model.layers.0.mlp.down_proj.weight": "F16"}
    assert pick(AUTO, loaded) == ("none", "float32")
    # Any GGUF block format is served as stored (app.model.quant.kquants), not as floats.
    loaded.tensor_types = {"model.layers.0.mlp.down_proj.weight": "Q8_0"}
    assert pick(AUTO, loaded) == ("int4", "bfloat16")
    loaded.tensor_types = {"model.layers.0.mlp.down_proj.weight": "Q4_0"}
    # Off the CPU (meta stands in for CUDA) the int4 kernel is not there: weights as
    # loaded, in bf16 (issue 18's default on a GPU).
    assert pick(AUTO, loaded, "meta") == ("none", "bfloat16")


def test_explicit_choices_win_over_auto(tokenizer, monkeypatch):
    fake_cpu(monkeypatch, True)
    loaded = tiny_loaded(tokenizer)
    loaded.tensor_types = {"model.layers.0.mlp.down_proj.weight": "Q4_1"}
    exact = ModelConfig(quantization="none", dtype="float32")
    assert pick(exact, loaded) == ("none", "float32")
    assert pick(replace(AUTO, dtype="float32"), loaded) == ("int4", "float32")
    assert pick(replace(AUTO, quantization="int4"), loaded) == ("int4", "bfloat16")


@pytest.mark.parametrize(
    ("cfg", "device", "message"),
    [
        (ModelConfig(quantization="int4", dtype="float16"), "cpu", "bfloat16"),
        (ModelConfig(quantization="int4"), "meta", "CPU"),
    ],
)
def test_int4_where_it_cannot_run_is_a_clear_error(tokenizer, cfg, device, message):
    with pytest.raises(ValueError, match=message):
        build_model(tiny_loaded(tokenizer), cfg, device, 256)
