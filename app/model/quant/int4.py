"""Group-wise 4-bit weights on the CPU: GGUF's Q4_0 / Q4_1 as they are, or floats rounded
to 4 bits in groups of 32.

Decode reads every weight once per step, so bytes per weight decide its speed: 4-bit
codes with a scale and an offset per 32 weights are ~5 bits a weight, against 32 for fp32.
The matmul is PyTorch's CPU kernel for weight-only int4
(`aten._weight_int4pack_mm_for_cpu`, the one torchao uses on CPUs): per group of 32 along
the input dimension, w = (q - 8) * scale + zero, q in 0..15.

llama.cpp's 4-bit blocks map onto that exactly, so the default model's weights are served
bit for bit as its GGUF stores them (no dequantize-then-requantize):

- Q4_1, w = d * q + m:   scale = d, zero = m + 8 d;
- Q4_0, w = d * (q - 8): scale = d, zero = 0.

The kernel's vectorized x86 code (AVX-512 and AVX2 alike) takes bf16 activations and
bf16 group scales and accumulates in fp32; fp32 activations go through a scalar loop that
computes the GGUF's own weights exactly but ~40x slower (bench/int4_kernels.py). So bf16
is the fast path, and rounding x, d and m + 8 d to bf16 (<= 0.4% each) is its price: on
the default model no more than bf16 activations cost anyway (bench/README.md, "int4
weights"). Weights that arrive as floats are rounded to nearest, asymmetric per group
(the Q4_1 form).

The codes are kept in the cache in a plain layout (`Int4Weight`: two codes a byte, row
major); the kernel's own packing depends on the CPU's vector width, so it is redone at
load (a fraction of a second for the default model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from app.model.arch import ArchConfig
from app.model.families import model_class
from app.model.llama import LlamaModel
from app.model.packed_linear import pack_weight, packable, packing_available
from app.model.quant.kquants import GroupLinear, GroupWeight

GROUP = 32  # weights per scale/zero pair; GGUF's Q4 block size

_pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def int4_shape_ok(out_features: int, in_features: int) -> bool:
    """The kernel works on blocks of 16 output rows and whole groups of inputs."""
    return out_features % 16 == 0 and in_features % GROUP == 0


@dataclass
class Int4Weight:
    """A weight [N, K] as 4-bit codes in groups of GROUP along K:
    w[n, k] = q[n, k] * scale[n, k // GROUP] + offset[n, k // GROUP], q in 0..15.

    GGUF's blocks are this form as they are (Q4_1: d and m; Q4_0: d and -8 d), and scale
    and offset are fp16 values, as the file stores them (held as fp32)."""

    codes: torch.Tensor  # uint8 [N, K / 2]: q[n, 2j] in the low nibble, q[n, 2j + 1] high
    scale: torch.Tensor  # float32 [N, K / GROUP]
    offset: torch.Tensor  # float32 [N, K / GROUP]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    def unpacked(self) -> torch.Tensor:
        """The codes q, uint8 [N, K]. (numpy: torch's uint8 bit operations ran ~40x slower
        here, seconds per model.)"""
        c = self.codes.numpy()
        q = np.empty((*c.shape, 2), dtype=np.uint8)
        np.bitwise_and(c, 0x0F, out=q[..., 0])
        np.right_shift(c, 4, out=q[..., 1])
        return torch.from_numpy(q).view(self.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        q = self.unpacked().view(n, k // GROUP, GROUP).float()
        return (q * self.scale[..., None] + self.offset[..., None]).reshape(n, k)

    @staticmethod
    def pack_codes(q: torch.Tensor) -> torch.Tensor:
        """uint8 codes [N, K] in 0..15 -> two a byte [N, K / 2]."""
        n = q.to(torch.uint8).numpy()
        return torch.from_numpy(n[:, 0::2] | (n[:, 1::2] << 4))

    @classmethod
    def cat(cls, parts: list[Int4Weight]) -> Int4Weight:
        """Stacked rows (the fused qkv and gate_up projections)."""
        fields = ("codes", "scale", "offset")
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in fields))

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.codes": self.codes,
            f"{prefix}.scale": self.scale,
            f"{prefix}.offset": self.offset,
        }

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], prefix: str) -> Int4Weight:
        return cls(*(state.pop(f"{prefix}.{f}") for f in ("codes", "scale", "offset")))


def quantize_rtn(w: torch.Tensor) -> Int4Weight:
    """Float weight [N, K] -> 4 bits per weight, rounded to nearest, with each group's
    minimum and maximum as the ends of its 16 levels, scale and offset in fp16 (llama.cpp's
    Q4_1)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    lo = lo.half().float()
    scale = ((hi - lo) / 15).half().float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round((g - lo[..., None]) * inv[..., None]).clamp_(0, 15)
    return Int4Weight(Int4Weight.pack_codes(q.reshape(n, k)), scale, lo)


def from_gguf_q4(blocks: np.ndarray, kind: str) -> Int4Weight:
    """Raw GGUF Q4_0 / Q4_1 blocks of a weight, uint8 [N, K / 32 * block bytes], rows in
    the order wanted -> the same codes, scales and offsets, bit for bit.

    A block is d (fp16), m (fp16, Q4_1 only), then 16 bytes: byte j holds weight j in its
    low nibble and weight j + 16 in its high one. Q4_1: w = d q + m; Q4_0: w = d (q - 8)."""
    head = {"Q4_0": 2, "Q4_1": 4}[kind]
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, head + GROUP // 2)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., head:]
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(n, -1)  # [N, K], in order
    if kind == "Q4_1":
        offset = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offset = -8 * d  # exact: a power of two times an fp16
    return Int4Weight(
        Int4Weight.pack_codes(torch.from_numpy(q)), torch.from_numpy(d), torch.from_numpy(offset)
    )


TILE = 16  # output rows a tile of Parley's q4_matmul


def parley_layout(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes, scales and offsets as app/model/kernels/qmatmul.cpp reads them: per tile
    of 16 rows, K / 4 chunks of 32 bytes (byte 2n + j of chunk c: q(n, 4c + j) low,
    q(n, 4c + 2 + j) high); scales and offsets fp16 [tiles, K / 32, 16]."""
    n, k = weight.shape
    tiles = n // TILE
    q = weight.unpacked().numpy().reshape(tiles, TILE, k // 4, 2, 2)  # (t, n, c, h, j)
    chunks = (q[:, :, :, 0, :] | (q[:, :, :, 1, :] << 4)).transpose(0, 2, 1, 3)  # (t, c, n, j)
    codes = torch.from_numpy(np.ascontiguousarray(chunks).reshape(-1))

    def tiled(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(tiles, TILE, k // GROUP).transpose(1, 2).contiguous().half()

    return codes, tiled(weight.scale), tiled(weight.offset)


def parley_available() -> bool:
    """Whether Parley's kernels (and so `parley.q4_matmul`) are loaded in this process."""
    return hasattr(torch.ops, "parley") and hasattr(torch.ops.parley, "q4_matmul")


class Int4Linear(nn.Module):
    """y = x W^T + b with W in 4-bit groups. Two kernels:

    - "parley" (app/model/kernels/qmatmul.cpp): bf16 activations against the codes with
      the file's fp16 scales, the same arithmetic for one row and for thousands, and fast
      at both (bf16 dot products where the CPU has them). The default where Parley's
      kernels are built.
    - "aten": PyTorch's CPU int4 kernel in `dtype` (bf16: vectorized; float32: exact but
      ~40x slower, for tests), with scale and zero rounded to `dtype`. A row's result never
      depends on its batch, but it dequantizes the weights again for every 4 rows: bound by
      that arithmetic at a prompt's row counts.

    Inputs of another dtype are converted in and the result converted back; the bias is
    added in the inputs' dtype (give it in that)."""

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        kernel: str = "aten",
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if not int4_shape_ok(self.out_features, self.in_features):
            raise ValueError(f"int4 needs rows % 16 == 0 and columns % {GROUP} == 0")
        if kernel not in ("aten", "parley"):
            raise ValueError(f"int4 kernel must be aten or parley, not {kernel!r}")
        self.kernel = kernel
        self.dtype = torch.bfloat16 if kernel == "parley" else dtype
        self.bias = bias
        if kernel == "parley":
            self.codes, self.d, self.m = parley_layout(weight)
            self.weight_nbytes = self.codes.numel() + self.d.nbytes + self.m.nbytes
            return
        self.packed = _pack(torch.from_numpy(weight.unpacked().numpy().astype(np.int32)), 1)
        # [K / GROUP, N, 2]: (scale, zero) of each group, in the kernel's dtype, for its
        # w = (q - 8) * scale + zero.
        zero = weight.offset + 8 * weight.scale
        self.scale_zero = torch.stack((weight.scale, zero), dim=-1).transpose(0, 1)
        self.scale_zero = self.scale_zero.contiguous().to(dtype)
        self.weight_nbytes = self.packed.numel() + self.scale_zero.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "parley":
            y = torch.ops.parley.q4_matmul(x.contiguous(), self.codes, self.d, self.m, x.dtype)
            return y if self.bias is None else y.add_(self.bias)
        if x.dtype == self.dtype and self.bias is None:
            return _int4_mm(x.contiguous(), self.packed, GROUP, self.scale_zero)
        y = _int4_mm(x.to(self.dtype).contiguous(), self.packed, GROUP, self.scale_zero)
        y = y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 on {self.kernel}, {self.dtype}"
        )


# -- the 4-bit model -----------------------------------------------------------------------

LINEARS = ("qkv", "o_proj", "gate_up", "down")


def decode_layers_weights(model: LlamaModel) -> list[torch.Tensor]:
    """What Parley's decode_layers reads (FusedCpuOps): every layer's int4 (codes, d, m)
    on Parley's q4_matmul for qkv, o_proj, gate_up and down, then its two norms' weights;
    empty unless every linear is such, without a bias."""
    out: list[torch.Tensor] = []
    for layer in model.layers:
        for name in LINEARS:  # qkv, o_proj, gate_up, down: the order decode_layers reads
            lin = getattr(layer, name)
            if not isinstance(lin, Int4Linear) or lin.kernel != "parley" or lin.bias is not None:
                return []
            out += [lin.codes, lin.d, lin.m]
        out += [layer.input_norm.weight, layer.post_norm.weight]
    return out


def normed_layers_weights(model: LlamaModel) -> tuple[list, list[int], list, list[int]] | None:
    """What Parley's decode_layers_normed reads of a family with q/k norms (Qwen3, Gemma 3):
    per layer its four linears as (3 tensors, 3 ints: (0, 0, 0) for int4 on q4_matmul, else
    (group, bits, base) of group_matmul), its norms' weights (input, post, q, k, then
    Gemma's attention and MLP output norms) and its window (0: global). None unless every
    linear runs on one of those kernels, without a bias or padded rows."""
    linears: list[torch.Tensor] = []
    kinds: list[int] = []
    norms: list[torch.Tensor] = []
    windows: list[int] = []
    for layer in model.layers:
        for name in LINEARS:  # qkv, o_proj, gate_up, down
            lin = getattr(layer, name)
            if isinstance(lin, Int4Linear) and lin.kernel == "parley" and lin.bias is None:
                linears += [lin.codes, lin.d, lin.m]
                kinds += [0, 0, 0]
            elif (
                isinstance(lin, GroupLinear) and lin.kernel and lin.bias is None
                and not lin.fp32_out and lin.out_features % TILE == 0
            ):  # fmt: skip
                w = lin.tiled
                linears += [w.codes, w.scale, torch.empty(0) if w.offset is None else w.offset]
                kinds += [w.group, w.bits, w.base]
            else:
                return None
        norms += [layer.input_norm.weight, layer.post_norm.weight]
        norms += [layer.q_norm.weight, layer.k_norm.weight]
        if hasattr(layer, "attn_out_norm"):
            norms += [layer.attn_out_norm.weight, layer.mlp_out_norm.weight]
        windows.append(getattr(layer, "window", None) or 0)
    return linears, kinds, norms, windows


def _parts(arch: ArchConfig) -> dict[str, list[tuple[str, int]]]:
    """Our fused linears as stacks of Hugging Face ones: (name, rows) from the top."""
    return {
        "qkv": [
            ("self_attn.q_proj", arch.q_size),
            ("self_attn.k_proj", arch.kv_size),
            ("self_attn.v_proj", arch.kv_size),
        ],
        "o_proj": [("self_attn.o_proj", arch.hidden_size)],
        "gate_up": [
            ("mlp.gate_proj", arch.intermediate_size),
            ("mlp.up_proj", arch.intermediate_size),
        ],
        "down": [("mlp.down_proj", arch.hidden_size)],
    }


Linear = Int4Weight | GroupWeight
# Our fused linears that a checkpoint may store fused already (Phi-3), by its name.
FUSED = {"qkv": "self_attn.qkv_proj", "gate_up": "mlp.gate_up_proj"}


def as_group(w: Int4Weight) -> GroupWeight:
    """The same weights as int8 codes (fused with parts of another format)."""
    return GroupWeight(w.unpacked().to(torch.int8), w.scale, w.offset, GROUP)


def int4_linears(
    arch: ArchConfig, weights: dict[str, torch.Tensor], stored: dict[str, Linear]
) -> tuple[dict[str, Linear], int]:
    """Every linear layer's weight, by our names ("layers.3.qkv"): each part the checkpoint
    stores in blocks (`stored`, by Hugging Face name) as it is, any other rounded to 4 bits
    from its rows of the float weight. A fused linear whose parts are all 4-bit is an
    Int4Weight (Parley's q4_matmul); one with a part in another format (a Q4_K_M file's
    Q6_K or Q8_0 rows beside Q4_K ones) a GroupWeight, every part's weights as they were.
    Also returns how many parts were stored."""
    out: dict[str, Linear] = {}
    as_stored = 0
    for i in range(arch.num_layers):
        for name, parts in _parts(arch).items():
            w = weights[f"layers.{i}.{name}.weight"]
            pieces: list[Linear] = []
            row = 0
            whole = stored.pop(f"model.layers.{i}.{FUSED.get(name, '-')}.weight", None)
            if whole is not None:  # stored fused, as Phi-3's files store qkv and gate_up
                parts, pieces = [], [whole]
                as_stored += 1
            for hf, rows in parts:
                piece = stored.pop(f"model.layers.{i}.{hf}.weight", None)
                if piece is None:
                    piece = quantize_rtn(w[row : row + rows])
                else:
                    as_stored += 1
                pieces.append(piece)
                row += rows
            if all(isinstance(p, Int4Weight) for p in pieces):
                out[f"layers.{i}.{name}"] = Int4Weight.cat(pieces)  # type: ignore[arg-type]
            else:
                groups = [as_group(p) if isinstance(p, Int4Weight) else p for p in pieces]
                out[f"layers.{i}.{name}"] = GroupWeight.cat(groups)
    return out, as_stored


def int4_state_dict(linears: dict[str, Linear]) -> dict[str, torch.Tensor]:
    """What the disk cache keeps: codes, scales and zeros of each linear."""
    state: dict[str, torch.Tensor] = {}
    for name, w in linears.items():
        state.update({k: v.contiguous() for k, v in w.state(name).items()})
    return state


def int4_from_state_dict(state: dict[str, torch.Tensor]) -> dict[str, Linear]:
    names = {k.rsplit(".", 1)[0] for k in state}
    return {
        name: GroupWeight.from_state(state, name)
        if f"{name}.gcodes" in state
        else Int4Weight.from_state(state, name)
        for name in sorted(names)
    }


def model_from_int4(
    arch: ArchConfig,
    weights: dict[str, torch.Tensor],
    linears: dict[str, Linear],
    dtype: torch.dtype,
    max_positions: int,
    kernel_dtype: torch.dtype = torch.bfloat16,
    kernel: str = "aten",
) -> LlamaModel:
    """The decoder with 4-bit linears and activations in `dtype`. The int4 matmuls run on
    `kernel` (Int4Linear: "parley" or "aten"); on ATen's, in `kernel_dtype`: bf16, the fast
    path, whatever `dtype` is (an fp32 model rounds only the matmuls' inputs to bf16);
    float32 is exact and ~40x slower, for tests. Parley's always takes bf16 inputs.

    From `weights` (our names, any float dtype) it takes what stays float: the embedding,
    the norms, biases, and the LM head. (Rounded to 4 bits the LM head costs the default
    model 4.6% perplexity and 14 of 20 greedy replies: see bench/README.md, "int4 weights".)
    Consumes `linears`."""
    model = model_class(arch)(arch, max_positions, dtype, device="meta")
    float_names = []
    for i, layer in enumerate(model.layers):
        for name in LINEARS:
            p = f"layers.{i}.{name}"
            bias = weights.get(f"{p}.bias")
            bias = None if bias is None else bias.to(dtype, copy=True)
            w = linears.pop(p)
            if isinstance(w, GroupWeight):
                linear: nn.Module = GroupLinear(w, bias, kernel=kernel == "parley")
            else:
                linear = Int4Linear(w, bias, kernel_dtype, kernel)
            setattr(layer, name, linear)
            float_names += [f"{p}.weight", f"{p}.bias"]
    # Copies in the model's dtype: the sources may be memory-mapped from the cache.
    plain = {k: v.to(dtype, copy=True) for k, v in weights.items() if k not in float_names}
    model.load_state_dict(plain, strict=True, assign=True)
    if packing_available() and packable(dtype):
        model.packed_lm_head = pack_weight(model.lm_head_weight.detach())
        model.lm_head = None
    return model.eval().requires_grad_(False)
