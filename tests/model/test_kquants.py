"""GGUF's block formats as stored (app.model.quant.kquants): every type read into codes,
scales and offsets whose dequantization is gguf's own, bit for bit; and its matmul on
parley.group_matmul against a float reference, the same bits for a row in any batch; the
kernel's tiled layout holds the same weights in as few bits a code as they need."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from gguf.quants import dequantize, quantize

from app.config import default_cache_dir
from app.model import kernels
from app.model.quant.kquants import (
    BLOCKS,
    GroupEmbedding,
    GroupLinear,
    GroupWeight,
    TiledGroupWeight,
    from_gguf,
)

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants.quantize makes these


@pytest.fixture(scope="module")
def parley_kernels():
    why = kernels.load(default_cache_dir())
    if why is not None:
        pytest.skip(why)


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw blocks [n, k / per * bytes] of `kind`: quantized by gguf where it can; else
    random bytes with finite fp16 super-block scales (every bit pattern of the codes and
    the packed sub-block scales is a valid block)."""
    rng = np.random.default_rng(seed)
    if kind in QUANTIZABLE:
        w = rng.standard_normal((n, k)).astype(np.float32) * rng.random((n, 1), np.float32)
        return quantize(w, GGML[kind])
    size, per = BLOCKS[kind]
    b = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    scales = (rng.random((n, k // per, 2)) * 0.02 + 1e-4).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        b[..., 208:210] = scales[..., 0:2]
    else:  # Q4_K, Q5_K: d, then dmin
        b[..., 0:4] = scales.reshape(n, k // per, 4)
    return b.reshape(n, -1)


def gguf_floats(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, GGML[kind]).astype(np.float32))


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_every_type_reads_as_gguf_dequantizes_it(kind):
    raw = random_blocks(kind, 24, 512)
    w = from_gguf(raw, kind)
    assert w.codes.dtype == torch.int8 and w.shape == (24, 512)
    assert w.group == (16 if kind == "Q6_K" else 32)
    want = gguf_floats(raw, kind)
    assert torch.equal(w.dequantize(), want)  # exact: no bit of the file lost
    ids = torch.tensor([3, 0, 23, 3])
    assert torch.equal(w.rows(ids), want[ids])
    assert torch.equal(GroupEmbedding(w, torch.float32)(ids), want[ids])


# The fewest bits a code each type's range needs in the kernel's layout.
TILED_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_the_tiled_layout_holds_the_files_weights_in_as_few_bits_as_they_need(kind):
    raw = random_blocks(kind, 37, 512, seed=5)  # 37 rows: the last tile padded
    w = from_gguf(raw, kind)
    tiled = TiledGroupWeight.tile(w)
    # Random Q8_0 codes span more than 64 values; random K-quant bytes use every code.
    assert tiled.bits == TILED_BITS.get(kind, 8)
    assert tiled.shape == w.shape and tiled.codes.shape[0] == 3
    # Scales (and offsets) in fp16 where the file's are fp16 values; K-quants' d * sc not.
    want_half = kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
    assert tiled.scale.dtype == (torch.float16 if want_half else torch.float32)
    assert tiled.codes.shape[2] == {4: 32, 5: 40}.get(tiled.bits, 64)  # bytes a chunk
    ids = torch.arange(37)
    assert torch.equal(tiled.row_codes(ids), w.codes.to(torch.int16))
    assert torch.equal(tiled.rows_of(ids), gguf_floats(raw, kind))
    some = torch.tensor([36, 0, 17, 16, 15])
    assert torch.equal(GroupEmbedding(tiled, torch.float32)(some), w.rows(some))


def test_an_unknown_type_is_a_clear_error():
    with pytest.raises(ValueError, match="IQ2_XS is not one of"):
        from_gguf(np.zeros((1, 66), np.uint8), "IQ2_XS")


def test_fused_parts_of_mixed_types_keep_every_weight():
    """qkv of a Q4_K_M file mixes types (Q5_0 q, Q8_0 v, ...): stacked at the finest
    group, a missing offset as zeros, each row still its file's weights."""
    parts = [("Q5_0", 8), ("Q6_K", 16), ("Q4_K", 8)]
    raws = [random_blocks(kind, rows, 256, seed=i) for i, (kind, rows) in enumerate(parts)]
    fused = GroupWeight.cat([from_gguf(r, kind) for r, (kind, _) in zip(raws, parts)])
    want = torch.cat([gguf_floats(r, kind) for r, (kind, _) in zip(raws, parts)])
    assert fused.group == 16 and fused.offset is not None
    assert torch.equal(fused.dequantize(), want)
    state = fused.state("layers.0.qkv")
    again = GroupWeight.from_state(state, "layers.0.qkv")
    assert not state and torch.equal(again.dequantize(), want)


@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_matmul_computes_x_w_t(parley_kernels, kind, dtype):
    raw = random_blocks(kind, 40, 512, seed=1)
    floats = gguf_floats(raw, kind)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(9)).to(dtype)
    lin = GroupLinear(from_gguf(raw, kind), bias=bias)
    assert lin.kernel
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = lin(x)
    # The kernel's bf16 dot products take x rounded to bf16 (exact where x is bf16).
    want = x.bfloat16().double() @ floats.double().t() + bias.double()
    assert y.dtype == dtype and y.shape == (5, 40)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y.double(), want, rtol=tol, atol=tol * 10)
    if dtype == torch.float32:  # the fallback computes the same function of x as it is
        slow = GroupLinear(from_gguf(raw, kind), bias=bias, kernel=False)
        exact = x.double() @ floats.double().t() + bias.double()
        assert torch.allclose(slow(x).double(), exact, rtol=1e-5, atol=1e-4)


def on_one_thread(lin, x: torch.Tensor) -> torch.Tensor:
    """lin(x) computed with torch's pool at one thread (restored after)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return lin(x)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K", "Q5_0", "Q8_0"])
def test_a_row_has_the_same_bits_in_any_batch_on_any_thread_count(parley_kernels, kind):
    raw = random_blocks(kind, 203, 512, seed=3)  # 203 rows: a ragged last tile
    lin = GroupLinear(from_gguf(raw, kind), fp32_out=True)
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(4)).bfloat16()
    whole = lin(x)
    for i in (0, 5, 36):
        assert torch.equal(lin(x[i : i + 1]), whole[i : i + 1])
    assert torch.equal(lin(x[3:20]), whole[3:20])
    assert torch.equal(lin(x[10:12]), whole[10:12])  # fewer rows than a tile: 2-row tiles
    assert torch.equal(lin(x[20:23]), whole[20:23])
    assert torch.equal(on_one_thread(lin, x), whole)


def q8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as q8_matmul quantizes it: per group of 32, s = max|x| / 127 (fp32) and
    codes x / s rounded half to even: (codes [M, K / 32, 32] int64, s [M, K / 32] fp32)."""
    xb = x.float().view(x.shape[0], -1, 32)
    s = xb.abs().amax(-1) / 127
    inv = torch.where(s != 0, 1 / s, torch.zeros_like(s))
    return torch.round(xb * inv[..., None]).clamp(-127, 127).long(), s


@pytest.mark.parametrize("m", [1, 7, 16, 37])
def test_q8_matmul_is_an_integer_dot_product_of_8_bit_activations(parley_kernels, m):
    """parley.q8_matmul (a Q8_0 LM head where the CPU has AVX-512 VNNI): per group, the
    integer dot product of the weight's codes and x's 8-bit codes, exact, times both
    scales; within fp32 rounding of that sum, and the same bits for a row in any batch, on
    any thread count."""
    raw = random_blocks("Q8_0", 203, 640, seed=5)  # 203 rows: a ragged last tile
    gw = from_gguf(raw, "Q8_0")
    lin = GroupLinear(gw, fp32_out=True, int8_x=True)
    assert lin.int8_x and "q8_matmul" in repr(lin)
    x = torch.randn(m, 640, generator=torch.Generator().manual_seed(6)).bfloat16()
    x[0, :32] = 0  # a group of zeros: scale 0, no division by it
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (m, 203)
    qx, s = q8_activations(x)
    t = torch.einsum("mgk,ngk->mng", qx, gw.codes.long().view(203, -1, 32))  # exact integers
    want = (t.double() * s.double()[:, None, :] * gw.scale.double()[None]).sum(-1)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-4)
    # Against the bf16 x of group_matmul: the same function of x, 8 bits of each group's
    # largest value instead of 8 significant bits of each x.
    exact = x.double() @ gw.dequantize().double().t()
    assert torch.allclose(y.double(), exact, rtol=0.05, atol=0.05 * exact.abs().max().item())
    for i in range(0, m, 5):
        assert torch.equal(lin(x[i : i + 1]), y[i : i + 1])
    assert torch.equal(on_one_thread(lin, x), y)


def test_8_bit_activations_need_a_q8_0_head(parley_kernels):
    with pytest.raises(ValueError, match="Q8_0"):
        GroupLinear(from_gguf(random_blocks("Q4_K", 16, 256), "Q4_K"), fp32_out=True, int8_x=True)
    with pytest.raises(ValueError, match="fp32"):
        GroupLinear(from_gguf(random_blocks("Q8_0", 16, 256), "Q8_0"), int8_x=True)


def test_int8_head_is_chosen_by_the_cpu_and_the_switch(parley_kernels, monkeypatch):
    """A Q8_0 head takes 8-bit activations where the kernels were built with AVX-512 VNNI
    (faked each way) unless PARLEY_INT8_HEAD=0; any other head never does."""
    from app.model.quant import kquants

    q8 = TiledGroupWeight.tile(from_gguf(random_blocks("Q8_0", 16, 256), "Q8_0"))
    k4 = TiledGroupWeight.tile(from_gguf(random_blocks("Q4_K", 16, 256), "Q4_K"))
    monkeypatch.setattr(kquants, "q8_native", lambda: True)
    assert kquants.int8_head_fits(q8) and not kquants.int8_head_fits(k4)
    monkeypatch.setenv("PARLEY_INT8_HEAD", "0")
    assert not kquants.int8_head_fits(q8)
    monkeypatch.delenv("PARLEY_INT8_HEAD")
    monkeypatch.setattr(kquants, "q8_native", lambda: False)
    assert not kquants.int8_head_fits(q8)
