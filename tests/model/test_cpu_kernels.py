"""Parley's fused CPU kernels (app/model/kernels) against the PyTorch ops they replace, and
the model with them against the model without."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from app.config import ModelConfig, default_cache_dir
from app.engine.engine_request import EngineRequest
from app.model import cpu, kernels
from app.model.attention import AttentionMetadata, _decode, additive_mask
from app.model.build import WeightFormat, _use_cpu_kernels
from app.model.llama import FusedCpuOps, LlamaModel, Rotary, TorchOps
from tests.tiny import tiny_arch, tiny_weights

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built():
    why = kernels.load(ModelConfig().cache_dir)
    assert why is None, why  # g++ and ninja are on every machine the suite runs on


@pytest.fixture(params=["amx", "vector"])
def attention_path(request):
    """Each attention path this machine runs: AMX's tile units where the linears run on
    them too (a CPU with AMX whose OS grants its tile state; bf16, head size 64), and the
    vector path, which any other machine, dtype or head size, or PARLEY_AMX=0, runs."""
    amx = torch.ops.parley.q4_amx()
    if request.param == "amx" and not amx:
        pytest.skip("no AMX here (or the OS has not granted its tile state)")
    torch.ops.parley.q4_amx(request.param == "amx")
    try:
        yield request.param
    finally:
        torch.ops.parley.q4_amx(amx)


def _amx_applies(path, dtype, head_dim):
    if path == "amx" and (dtype != torch.bfloat16 or head_dim != 64):
        pytest.skip("AMX attention is for bf16 and head size 64: the vector path's case")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_rounds_as_torch(dtype, rows):
    g = _gen(rows)
    x = (3 * torch.randn(rows, 576, generator=g)).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    r = torch.randn(rows, 576, generator=g).to(dtype)
    ours = torch.ops.parley.rms_norm(x, w, 1e-5)
    ref = F.rms_norm(x, (576,), w, 1e-5)
    normed, total = torch.ops.parley.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, x + r)  # the residual sum is stored exactly as the add would
    assert torch.equal(normed, torch.ops.parley.rms_norm(x + r, w, 1e-5))
    if dtype == torch.bfloat16:  # the sum's order shows only where a value sits on a tie
        assert (ours != ref).float().mean() < 1e-3
    else:  # fp32: within 2 ulp
        torch.testing.assert_close(ours, ref, rtol=3e-7, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_equals_rotate_and_index_copy(dtype):
    arch = tiny_arch(32, num_heads=6, num_kv_heads=2, head_dim=64, hidden_size=384)
    rotary = Rotary(arch, 512).to(dtype)
    H, Hkv, D = arch.num_heads, arch.num_kv_heads, arch.head_dim
    qkv = torch.randn(7, (H + 2 * Hkv) * D, generator=_gen(1)).to(dtype)
    positions = torch.tensor([0, 1, 15, 16, 200, 201, 511])
    slots = torch.tensor([3, 40, 41, 50, 7, 8, 63])
    kc, vc = torch.zeros(4, 16, Hkv, D, dtype=dtype), torch.zeros(4, 16, Hkv, D, dtype=dtype)
    qk = torch.ops.parley.rope_store(qkv, rotary.cos, rotary.sin, positions, slots, kc, vc, H, Hkv)
    ref = Rotary.rotate(qkv[:, : (H + Hkv) * D].view(7, -1, D), rotary.at(positions))
    assert torch.equal(qk, ref)
    assert torch.equal(kc.view(-1, Hkv, D)[slots], ref[:, H:])
    assert torch.equal(vc.view(-1, Hkv, D)[slots], qkv[:, (H + Hkv) * D :].view(7, Hkv, D))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not kc.view(-1, Hkv, D)[untouched].any() and not vc.view(-1, Hkv, D)[untouched].any()


def _reference_decode(q, kc, vc, tables, lens, window=0):
    """Softmax attention in float64, each sequence's keys read through its block table (with
    a window, its last `window` keys)."""
    B, H, D = q.shape
    Hkv = kc.shape[2]
    out = []
    for b in range(B):
        first = max(0, int(lens[b]) - window) if window else 0
        keys = slice(first, int(lens[b]))
        ks = kc[tables[b]].reshape(-1, Hkv, D)[keys].double().repeat_interleave(H // Hkv, 1)
        vs = vc[tables[b]].reshape(-1, Hkv, D)[keys].double().repeat_interleave(H // Hkv, 1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), ks) * D**-0.5
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vs))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 16])  # the specialised loops, and the general ones
def test_paged_decode_against_float64_and_alone_as_batched(dtype, head_dim, attention_path):
    _amx_applies(attention_path, dtype, head_dim)
    H, Hkv, bs = 9, 3, 16
    g = _gen(head_dim)
    kc = torch.randn(200, bs, Hkv, head_dim, generator=g).to(dtype)
    vc = torch.randn(200, bs, Hkv, head_dim, generator=g).to(dtype)
    lens = torch.tensor([1, 55, 511, 512, 513, 1300])  # around the 512-key spans
    tables = torch.stack([torch.randperm(200, generator=g)[:100] for _ in lens])
    q = torch.randn(len(lens), H, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = torch.ops.parley.paged_decode(q, kc, vc, tables, lens, scale)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    torch.testing.assert_close(
        out.double(), _reference_decode(q, kc, vc, tables, lens), rtol=0, atol=tol
    )
    for b in range(len(lens)):  # alone: the same bits
        one = slice(b, b + 1)
        alone = torch.ops.parley.paged_decode(q[one], kc, vc, tables[one], lens[one], scale)
        assert torch.equal(alone[0], out[b])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "heads"), [(64, (9, 3)), (16, (9, 3)), (128, (8, 2)), (64, (10, 2))]
)
@pytest.mark.parametrize("block_size", [16, 7])
def test_paged_prefill_gives_each_row_a_decodes_bits(
    dtype, head_dim, heads, block_size, attention_path
):
    """A prompt chunk's rows, each attending to the keys up to its position, equal decodes
    at those positions bit for bit: fresh prompts, chunks after a cached prefix (a long
    one, a short follow-up, a single row), across the 512-key spans. Head sizes whose
    decodes run on vectors (64, 128; with 3, 4 or 5 query heads a K/V head, which
    paged_decode's weighted sum of V takes 4, 2 and 1 at a time) and one that does not (16)."""
    _amx_applies(attention_path, dtype, head_dim)
    H, Hkv = heads
    g = _gen(head_dim + block_size)
    blocks = 1400 // block_size + 2
    kc = torch.randn(blocks, block_size, Hkv, head_dim, generator=g).to(dtype)
    vc = torch.randn(blocks, block_size, Hkv, head_dim, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g)
    scale = head_dim**-0.5
    for start, n in [(0, 1), (0, 37), (0, 700), (300, 19), (510, 5), (1023, 1), (1000, 300)]:
        q = torch.randn(n, H, head_dim, generator=g).to(dtype)
        out = torch.ops.parley.paged_prefill(q, kc, vc, table, start, scale)
        lens = torch.arange(start + 1, start + n + 1)
        decodes = torch.ops.parley.paged_decode(q, kc, vc, table.expand(n, -1), lens, scale)
        assert torch.equal(out, decodes), (start, n)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    ref = _reference_decode(q, kc, vc, table.expand(n, -1), lens)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "heads"), [(64, (9, 3)), (16, (9, 3)), (256, (4, 1))])
def test_a_sliding_window_attends_its_last_keys_alike_decoded_prompted_or_chunked(
    dtype, head_dim, heads, attention_path
):
    """Gemma's local layers: each row attends to its last `window` keys only, in the same
    bits decoded, in a whole prompt, in chunks after a cached prefix, and close to float64
    attention over exactly those keys. Windows shorter than a score block (1, 5), across the
    512-key spans (512, 700), and one longer than the context (a window that changes
    nothing: the same bits as none)."""
    _amx_applies(attention_path, dtype, head_dim)
    (H, Hkv), bs = heads, 16
    g = _gen(head_dim + 3)
    blocks = 1300 // bs + 2
    kc = torch.randn(blocks, bs, Hkv, head_dim, generator=g).to(dtype)
    vc = torch.randn(blocks, bs, Hkv, head_dim, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g)
    q = torch.randn(1300, H, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    lens = torch.arange(1, 1301)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    for window in (1, 5, 512, 700, 5000):
        whole = torch.ops.parley.paged_prefill(q, kc, vc, table, 0, scale, window)
        cuts = [0, 37, 38, 600, 1100, 1300]
        chunks = [torch.ops.parley.paged_prefill(q[a:b], kc, vc, table, a, scale, window)
                  for a, b in itertools.pairwise(cuts)]  # fmt: skip
        assert torch.equal(torch.cat(chunks), whole), window
        at = torch.tensor([0, 4, 5, 511, 512, 699, 700, 1023, 1299])  # decodes here
        decodes = torch.ops.parley.paged_decode(
            q[at], kc, vc, table.expand(len(at), -1), lens[at], scale, window
        )
        assert torch.equal(decodes, whole[at]), window
        ref = _reference_decode(q[at], kc, vc, table.expand(len(at), -1), lens[at], window)
        torch.testing.assert_close(decodes.double(), ref, rtol=0, atol=tol)
    none = torch.ops.parley.paged_prefill(q[:40], kc, vc, table, 1000, scale)
    assert torch.equal(torch.ops.parley.paged_prefill(q[:40], kc, vc, table, 1000, scale, 5000),
                       none)  # fmt: skip


def _bf16_cache(seed: int, blocks: int, rows: int):
    """A random bf16 K/V cache of `blocks` blocks of 16 (9 query heads over 3 K/V heads of
    64), its sequence's block table and `rows` queries."""
    H, Hkv, D, bs = 9, 3, 64, 16
    g = _gen(seed)
    kc = torch.randn(blocks, bs, Hkv, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(blocks, bs, Hkv, D, generator=g).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=g)
    return kc, vc, table, torch.randn(rows, H, D, generator=g).to(torch.bfloat16)


def test_a_prompt_in_chunks_attends_as_the_whole_prompt(attention_path):
    kc, vc, table, q = _bf16_cache(11, 64, 900)
    whole = torch.ops.parley.paged_prefill(q, kc, vc, table, 0, 0.125)
    cuts = [0, 300, 301, 333, 900]
    chunks = [torch.ops.parley.paged_prefill(q[a:b], kc, vc, table, a, 0.125)
              for a, b in itertools.pairwise(cuts)]  # fmt: skip
    assert torch.equal(torch.cat(chunks), whole)


def test_keys_past_a_rows_reach_change_nothing_even_as_nan(attention_path):
    """The cache's slots past a sequence's length (and before a window) may hold anything:
    stale K/V, or NaN in memory never written. The tile path reads whole blocks of 32
    keys; those it must not use weigh nothing, so NaN there changes no bit."""
    kc, vc, table, q = _bf16_cache(21, 48, 40)
    Hkv, D, bs = kc.shape[2], kc.shape[3], kc.shape[1]
    start, n = 500, 40  # keys 0 .. 539 in use: the rest of the 32-key block is not
    for window in (0, 100):
        clean_p = torch.ops.parley.paged_prefill(q, kc, vc, table, start, 0.125, window)
        lens = torch.arange(start + 1, start + n + 1)
        clean_d = torch.ops.parley.paged_decode(q, kc, vc, table.expand(n, -1), lens, 0.125, window)
        dirty_k, dirty_v = kc.clone(), vc.clone()
        slots = table.repeat_interleave(bs) * bs + torch.arange(bs).repeat(48)
        unused = slots[start + n :]
        if window:
            unused = torch.cat([unused, slots[: start - window]])
        dirty_k.view(-1, Hkv, D)[unused] = float("nan")
        dirty_v.view(-1, Hkv, D)[unused] = float("nan")
        dirty_p = torch.ops.parley.paged_prefill(q, dirty_k, dirty_v, table, start, 0.125, window)
        assert torch.equal(dirty_p, clean_p)
        assert torch.equal(
            torch.ops.parley.paged_decode(q, dirty_k, dirty_v, table.expand(n, -1), lens, 0.125,
                                          window),
            clean_d,
        )  # fmt: skip
        assert torch.equal(clean_p, clean_d)


def test_amx_attention_is_its_own_arithmetic_and_as_close_to_float64():
    """Where AMX runs, attention's sums take the tile unit's order (a path of its own, not
    the vector one's bits) with the probabilities kept to ~16 bits (two bf16 parts): as
    close to float64 as the vector path."""
    if not torch.ops.parley.q4_amx():
        pytest.skip("no AMX here (or the OS has not granted its tile state)")
    kc, vc, table, q = _bf16_cache(22, 80, 1200)
    outs = {}
    try:
        for amx in (True, False):
            torch.ops.parley.q4_amx(amx)
            outs[amx] = torch.ops.parley.paged_prefill(q, kc, vc, table, 0, 0.125)
    finally:
        torch.ops.parley.q4_amx(True)
    assert not torch.equal(outs[True], outs[False])
    at = torch.tensor([0, 31, 32, 511, 512, 777, 1199])
    ref = _reference_decode(q[at], kc, vc, table.expand(len(at), -1), at + 1)
    err = {amx: (o[at].double() - ref).abs().max().item() for amx, o in outs.items()}
    assert err[True] < 8e-3 and err[True] <= 1.5 * err[False], err


def test_the_attention_path_is_named_as_it_runs():
    """The start-up log's attention path: AMX exactly where the kernels take it (bf16, head
    size 64, a process with AMX on), the vector path for every other case."""
    amx = torch.ops.parley.q4_amx()
    try:
        for on in (True, False):
            torch.ops.parley.q4_amx(on)
            want = "AMX (tdpbf16ps)" if on and torch.ops.parley.q4_amx() else "vector"
            assert torch.ops.parley.attention_path(torch.bfloat16, 64, 3) == want
            assert torch.ops.parley.attention_path(torch.float32, 64, 3) == "vector"
            assert torch.ops.parley.attention_path(torch.bfloat16, 128, 3) == "vector"
            assert torch.ops.parley.attention_path(torch.bfloat16, 64, 17) == "vector"
    finally:
        torch.ops.parley.q4_amx(amx)


def test_paged_decode_close_to_the_gathered_sdpa_path():
    H, Hkv, D, bs = 9, 3, 64, 16
    g = _gen(3)
    kc = torch.randn(64, bs, Hkv, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(64, bs, Hkv, D, generator=g).to(torch.bfloat16)
    lens = torch.tensor([30, 250])
    tables = torch.stack([torch.randperm(64, generator=g)[:16] for _ in lens])
    q = torch.randn(2, H, D, generator=g).to(torch.bfloat16)
    keep = torch.arange(16 * bs)[None, :] < lens[:, None]
    meta = AttentionMetadata(torch.empty(0), 2, tables, additive_mask(keep, q.dtype)[:, None, None])
    sdpa = _decode(q, kc, vc, meta, D**-0.5)
    meta.decode_lens = lens
    ours = _decode(q, kc, vc, meta, D**-0.5)
    torch.testing.assert_close(ours.float(), sdpa.float(), rtol=0, atol=8e-3)


def test_bad_input_is_refused_with_a_reason():
    kc = torch.zeros(4, 16, 2, 16)
    q = torch.zeros(1, 4, 16)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        torch.ops.parley.paged_decode(q, kc, kc, torch.zeros(1, 2, dtype=torch.long),
                                      torch.tensor([33]), 0.25)  # fmt: skip
    with pytest.raises(RuntimeError, match="block 9 is outside the cache"):
        torch.ops.parley.paged_decode(q, kc, kc, torch.tensor([[0, 9]]), torch.tensor([20]), 0.25)
    with pytest.raises(RuntimeError, match="exceed its block table"):
        torch.ops.parley.paged_prefill(q, kc, kc, torch.tensor([0, 1]), 32, 0.25)
    with pytest.raises(RuntimeError, match="block 9 is outside the cache"):
        torch.ops.parley.paged_prefill(q, kc, kc, torch.tensor([0, 9]), 20, 0.25)
    rotary = Rotary(tiny_arch(32), 8)
    qkv = torch.zeros(1, (4 + 2 * 2) * 16)
    for pos, slot, why in ((0, 64, "slot 64 is outside"), (8, 0, "position 8 is past")):
        with pytest.raises(RuntimeError, match=why):
            torch.ops.parley.rope_store(qkv, rotary.cos, rotary.sin, torch.tensor([pos]),
                                        torch.tensor([slot]), kc, kc.clone(), 4, 2)  # fmt: skip
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.parley.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_model_with_kernels_matches_the_model_without(dtype):
    """The tiny model over a paged cache: a prompt in two chunks, then decodes, with
    PyTorch's ops and with the kernels; the logits agree to the dtype's rounding."""
    arch = tiny_arch(97)
    weights = {k: v.to(dtype) for k, v in tiny_weights(arch).items()}
    runs = []
    for ops in (TorchOps(), FusedCpuOps()):
        model = LlamaModel.from_weights(arch, dict(weights), 256)
        model.use_ops(ops)
        shape = (8, 16, arch.num_kv_heads, arch.head_dim)
        caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                  for _ in range(arch.num_layers)]  # fmt: skip
        ids = torch.randint(0, 97, (40,), generator=_gen(5))
        logits = [model.forward_tokens(ids[:30].tolist())[-1]]
        # forward_tokens uses a scratch cache; decode the rest over `caches` one token a step
        from app.model.attention import PrefillChunk

        table = torch.arange(8)
        meta = AttentionMetadata(slot_mapping=torch.arange(30),
                                 prefills=[PrefillChunk(0, 30, 30, None, None)])  # fmt: skip
        model(ids[:30], torch.arange(30), caches, meta, torch.tensor([29]))
        for p in range(30, 40):
            lens = torch.tensor([p + 1])
            meta = AttentionMetadata(torch.tensor([p]), 1, table[None])
            if ops.fused:
                meta.decode_lens = lens
            else:
                keep = torch.arange(8 * 16)[None, :] < lens[:, None]
                meta.decode_mask = additive_mask(keep, dtype)[:, None, None]
            logits.append(model(ids[p : p + 1], torch.tensor([p]), caches, meta,
                                torch.tensor([0]))[0])  # fmt: skip
        runs.append(torch.stack(logits).float())
    scale = runs[0].abs().max().item()  # bf16: a few of the largest logit's ulps (2^-8)
    tol = 1e-5 * scale if dtype == torch.float32 else 2e-2 * scale
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=tol)
    if dtype == torch.float32:
        assert torch.equal(runs[1].argmax(-1), runs[0].argmax(-1))


def test_off_or_unbuildable_means_pytorch_ops(monkeypatch, caplog):
    arch = tiny_arch(32)
    fmt = WeightFormat("none", "float32")
    model = LlamaModel.from_weights(arch, tiny_weights(arch), 64)
    _use_cpu_kernels(model, ModelConfig(), fmt)  # auto: not for weights as loaded
    assert not model.ops.fused and not model.layers[0].ops.fused
    _use_cpu_kernels(model, ModelConfig(cpu_kernels="off"), WeightFormat("int4", "bfloat16"))
    assert not model.ops.fused
    monkeypatch.setattr(kernels, "load", lambda cache_dir: "the kernels did not build (no g++)")
    with caplog.at_level("INFO", logger="app.model.build"):
        _use_cpu_kernels(model, ModelConfig(cpu_kernels="on"), fmt)
    assert not model.ops.fused
    assert "no g++" in caplog.text
    monkeypatch.undo()
    _use_cpu_kernels(model, ModelConfig(cpu_kernels="on"), fmt)
    assert model.ops.fused and all(layer.ops.fused for layer in model.layers)


@pytest.mark.parametrize("avx512", [True, False])
def test_prompts_attend_through_the_kernel_where_the_cpu_has_avx512(monkeypatch, avx512):
    """The choice by CPU (faked both ways): the kernel for prompts with AVX-512, PyTorch's
    flash kernel without; forward_tokens follows it, as the model runner does."""
    monkeypatch.setattr(cpu, "cpu_has_avx512", lambda: avx512)
    arch = tiny_arch(32)
    model = LlamaModel.from_weights(arch, tiny_weights(arch), 64)
    _use_cpu_kernels(model, ModelConfig(cpu_kernels="on"), WeightFormat("none", "float32"))
    assert model.ops.fused and model.ops.prefill_in_place == avx512
    calls = []
    real = torch.ops.parley.paged_prefill
    monkeypatch.setattr(torch.ops.parley, "paged_prefill", lambda *a: calls.append(1) or real(*a))
    model.forward_tokens(list(range(20)))
    assert len(calls) == (arch.num_layers if avx512 else 0)


def test_auto_serves_the_default_model_with_the_kernels(smollm):
    from app.model.build import build_model

    built = build_model(smollm, ModelConfig(), "cpu", 512)
    assert built.format.quantization == "int4" and built.model.ops.fused
    exact = build_model(smollm, ModelConfig(quantization="none", dtype="float32"), "cpu", 512)
    assert not exact.model.ops.fused  # the exact reference: PyTorch's ops


def test_an_avx2_build_computes_the_same(tmp_path, avx2_build):
    """The same source built for an AVX2-only CPU (x86-64-v3), in a process of its own (one
    build a process): its results equal this machine's native build's, bit for bit: every sum
    is taken in lanes of a fixed order whatever the vector width. (The int4 matmul's vector
    path, that is: where the machine has AMX its tile units round their own way, and the
    native process is run with PARLEY_AMX=0.) The native build is the one the suite uses,
    the AVX2 one the session's (tests/model/conftest.py)."""
    caches = {"native": default_cache_dir(), avx2_build[1]: avx2_build[0]}
    script = textwrap.dedent(
        """
        import sys, torch
        from pathlib import Path
        from app.model import cpu, kernels
        assert kernels.load(Path(sys.argv[3]), march=sys.argv[1]) is None
        assert "AMX" not in torch.ops.parley.q4_path()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(33, 576, generator=g).bfloat16()
        w = torch.randn(576, generator=g).bfloat16()
        kc = torch.randn(64, 16, 3, 64, generator=g).bfloat16()
        vc = torch.randn(64, 16, 3, 64, generator=g).bfloat16()
        q = torch.randn(2, 9, 64, generator=g).bfloat16()
        tables = torch.stack([torch.randperm(64, generator=g)[:40] for _ in range(2)])
        from app.model.quant.int4 import Int4Linear, quantize_rtn
        q4 = Int4Linear(quantize_rtn(torch.randn(96, 576, generator=g)), None, x.dtype, "parley")
        codes = torch.randint(-128, 128, (70, 576), generator=g, dtype=torch.int8)
        scales = torch.rand(70, 18, generator=g)
        from app.model.quant.kquants import GroupLinear, GroupWeight
        groups = {}  # group_matmul at each code width, with and without offsets
        for lo, hi, group, off in [(0, 16, 32, True), (-16, 16, 32, False),
                                   (-32, 32, 16, False), (-128, 128, 32, False)]:
            gscale = torch.rand(48, 576 // group, generator=g)
            if lo == -16:  # fp16 scales (as Q5_0's are), the kernel's other scale type
                gscale = gscale.half().float()
            gw = GroupWeight(torch.randint(lo, hi, (48, 576), generator=g).to(torch.int8),
                             gscale,
                             torch.randn(48, 576 // group, generator=g) if off else None, group)
            lin = GroupLinear(gw, fp32_out=True)
            assert (lin.tiled.scale.dtype == torch.float16) == (lo == -16)
            groups[lin.tiled.bits] = [lin(x), lin(x[:1])]
        # A Q8_0 head with x as 8-bit codes: VNNI's vpdpbusd against the portable loop
        q8_codes = torch.randint(-127, 128, (48, 576), generator=g).to(torch.int8)
        q8_scales = torch.rand(48, 18, generator=g).half().float()
        q8 = GroupLinear(GroupWeight(q8_codes, q8_scales, None, 32), fp32_out=True, int8_x=True)
        # Gemma's head size (4 query heads on one K/V head of 256) and fp32 K/V
        kc256 = torch.randn(64, 16, 1, 256, generator=g).bfloat16()
        vc256 = torch.randn(64, 16, 1, 256, generator=g).bfloat16()
        q256 = torch.randn(2, 4, 256, generator=g).bfloat16()
        out = dict(norm=torch.ops.parley.rms_norm(x, w, 1e-5),
                   head=torch.ops.parley.block_matmul(x, codes, scales),
                   head_bf16=torch.ops.parley.block_matmul(x, codes.bfloat16(), None),
                   q4=torch.ops.parley.q4_matmul(x, q4.codes, q4.d, q4.m, torch.float32),
                   groups=groups,
                   q8=[q8(x), q8(x[:1]), torch.ops.parley.q8_path()],
                   attn=torch.ops.parley.paged_decode(q, kc, vc, tables, torch.tensor([7, 600]),
                                                      0.125),
                   prompt=torch.ops.parley.paged_prefill(q.repeat(20, 1, 1), kc, vc, tables[0],
                                                         560, 0.125),
                   window=torch.ops.parley.paged_decode(q, kc, vc, tables,
                                                        torch.tensor([7, 600]), 0.125, 100),
                   prompt_window=torch.ops.parley.paged_prefill(q.repeat(20, 1, 1), kc, vc,
                                                                tables[0], 560, 0.125, 100),
                   attn256=torch.ops.parley.paged_decode(q256, kc256, vc256, tables,
                                                         torch.tensor([7, 600]), 0.0625),
                   attn_fp32=torch.ops.parley.paged_decode(q.float(), kc.float(), vc.float(),
                                                           tables, torch.tensor([7, 600]),
                                                           0.125))
        torch.save(out, sys.argv[2])
        """
    )
    for march, cache in caches.items():
        subprocess.run([sys.executable, "-c", script, march, str(tmp_path / f"{march}.pt"),
                        str(cache)], check=True, timeout=600,
                       env={**os.environ, "PARLEY_AMX": "0"})  # fmt: skip
    native = torch.load(tmp_path / "native.pt")
    avx2 = torch.load(tmp_path / "x86-64-v3.pt")
    assert torch.equal(native["norm"], avx2["norm"])  # same lanes, same order, any width
    # The AVX-512 dot products and exponentials (intrinsics) against AVX2's portable loops.
    assert torch.equal(native["attn"], avx2["attn"])
    assert torch.equal(native["prompt"], avx2["prompt"])
    assert torch.equal(native["window"], avx2["window"])  # a sliding window's bounds too
    assert torch.equal(native["prompt_window"], avx2["prompt_window"])
    assert torch.equal(native["attn256"], avx2["attn256"])  # two heads and 32 dims a pass
    assert torch.equal(native["attn_fp32"], avx2["attn_fp32"])
    # The LM head: 16 lanes in AVX-512 registers, pairs of AVX2 ones, the same tree.
    assert torch.equal(native["head"], avx2["head"])
    assert torch.equal(native["head_bf16"], avx2["head_bf16"])
    # int4: vdpbf16ps (AVX-512 BF16) against fp32 FMAs in its order (AVX2): the same bits.
    assert torch.equal(native["q4"], avx2["q4"])
    # group_matmul likewise, at 4-, 5-, 6- and 8-bit codes, a prompt's rows and a decode's.
    assert sorted(native["groups"]) == [4, 5, 6, 8]
    for bits, (rows, row) in native["groups"].items():
        assert torch.equal(rows, avx2["groups"][bits][0]) and torch.equal(row, rows[:1])
        assert torch.equal(row, avx2["groups"][bits][1])
    # q8_matmul's integer sums: vpdpbusd (AVX-512 VNNI) against the portable loop.
    assert avx2["q8"][2].startswith("portable")
    assert native["q8"][2].startswith("AVX-512 VNNI") == ("avx512_vnni" in cpu.cpu_flags())
    assert torch.equal(native["q8"][0], avx2["q8"][0])
    assert torch.equal(native["q8"][1], avx2["q8"][1])
    assert torch.equal(native["q8"][1], native["q8"][0][:1])


def test_the_layer_stack_in_one_call_equals_layer_by_layer(smollm, monkeypatch):
    """The default model (int4 weights, bf16): decode steps through decode_layers (one C++
    call for the 30 layers) give the same bits as the Python layers with the same kernels."""
    from app.config import CacheConfig, EngineConfig
    from app.engine.engine import LLMEngine
    from app.engine.request import SamplingParams

    config = EngineConfig(model=ModelConfig(), cache=CacheConfig(64 << 20))  # auto: on
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
    prompts = [smollm.tokenizer.encode(t) for t in ("The lighthouse keeper", "Once upon a")]
    calls = []
    runs = []
    for stacked in (True, False):
        engine = LLMEngine(config, smollm)
        assert engine.model.ops.fused
        one_call = type(engine.model.ops).decode_layers

        def spy(self, *args, _real=one_call, _on=stacked):
            out = _real(self, *args) if _on else None
            calls.append(out is not None)
            return out

        monkeypatch.setattr(type(engine.model.ops), "decode_layers", spy)
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
    assert runs[0] == runs[1]


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path):
    import os
    import time

    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    fresh.touch()
    stale.touch()
    old = time.time() - kernels.STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    kernels._clear_stale_lock(fresh)
    kernels._clear_stale_lock(stale)
    kernels._clear_stale_lock(tmp_path / "absent")
    assert fresh.exists() and not stale.exists()
