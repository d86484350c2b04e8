"""GGUF's 5-, 6- and 8-bit blocks and its K-quants (Q4_K, Q5_K, Q6_K), read as they are
stored into one group-wise form, and their matmul on Parley's kernel
(app/model/kernels/qmatmul.cpp: `parley.group_matmul`).

Every one of these formats is, per group of 16 or 32 weights along a row,
w = scale * q + offset with a small integer code q:

- Q8_0: q int8, scale d (fp16), per 32;             - Q5_0: q - 16 in -16..15, scale d;
- Q5_1: q in 0..31, scale d, offset m (fp16s);      - Q4_0 / Q4_1: as Q5_0 / Q5_1, 4 bits;
- Q4_K, Q5_K: super-blocks of 256 with fp16 d and dmin and a 6-bit scale sc and min mb per
  32: scale d * sc, offset -dmin * mb, q in 0..15 (Q4_K) or 0..31 (Q5_K);
- Q6_K: super-blocks of 256, fp16 d and an int8 scale per 16: scale d * sc, q - 32.

The products d * sc and dmin * mb are exact in fp32 (at most 11 + 8 bits), and so is
scale * q (at most 24 bits); scale * q + offset then rounds once, as llama.cpp's and
`gguf.quants.dequantize`'s fp32 arithmetic does: `GroupWeight.dequantize` gives their bits.
Nothing is rounded to fewer bits than the file has.

`GroupWeight` holds the codes as int8 rows (the form the cache stores); `TiledGroupWeight`
is the kernel's layout, made at load: tiles of 16 rows, each code in the fewest of 4, 5, 6
or 8 bits that its weight's range needs (two 4-bit codes a byte; 5 bits as those and a
plane of fifth bits; 6 and 8 bits one a byte), scales and offsets beside them (fp16 where
every one is an fp16 value, as Q8_0's and Q5_0's are; else fp32). A tied embedding looks its
rows up in the same tiled bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

QK_K = 256  # weights a K-quant super-block
# Bytes a block, and weights a block, of each type this module reads.
BLOCKS = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q8_0": (34, 32),
    "Q4_K": (144, QK_K),
    "Q5_K": (176, QK_K),
    "Q6_K": (210, QK_K),
}
GROUP_TYPES = frozenset(BLOCKS)


@dataclass
class GroupWeight:
    """A weight [N, K] as int8 codes with a scale (and an offset) per `group` along K:
    w[n, k] = codes[n, k] * scale[n, k // group] + offset[n, k // group]."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / group]
    offset: torch.Tensor | None  # float32 [N, K / group], None: zero
    group: int  # 16 or 32

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` [T] -> [T, K], as the file's own dequantization gives them."""
        codes, scale = self.codes[ids], self.scale[ids]
        t, k = codes.shape
        w = codes.view(t, k // self.group, self.group).float() * scale[..., None]
        if self.offset is not None:
            w += self.offset[ids][..., None]
        return w.view(t, k)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0]))

    def regrouped(self, group: int) -> GroupWeight:
        """The same weights with a scale (and offset) per `group` (a divisor of ours)."""
        if group == self.group:
            return self
        r = self.group // group
        offset = None if self.offset is None else self.offset.repeat_interleave(r, dim=1)
        return GroupWeight(self.codes, self.scale.repeat_interleave(r, dim=1), offset, group)

    @classmethod
    def cat(cls, parts: list[GroupWeight]) -> GroupWeight:
        """Stacked rows (the fused qkv and gate_up projections), at the finest group size
        among them; offsets of zero where a part has none."""
        group = min(p.group for p in parts)
        parts = [p.regrouped(group) for p in parts]
        codes = torch.cat([p.codes for p in parts])
        scale = torch.cat([p.scale for p in parts])
        offset = None
        if any(p.offset is not None for p in parts):
            offset = torch.cat(
                [p.offset if p.offset is not None else torch.zeros_like(p.scale) for p in parts]
            )
        return cls(codes, scale, offset, group)

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {
            f"{prefix}.gcodes": self.codes,
            f"{prefix}.gscale": self.scale,
            f"{prefix}.ggroup": torch.tensor([self.group]),
        }
        if self.offset is not None:
            out[f"{prefix}.goffset"] = self.offset
        return out

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], prefix: str) -> GroupWeight:
        return cls(
            state.pop(f"{prefix}.gcodes"),
            state.pop(f"{prefix}.gscale"),
            state.pop(f"{prefix}.goffset", None),
            int(state.pop(f"{prefix}.ggroup")[0]),
        )


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes a value at the end of `b` [..., 2] -> fp32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes [..., run] -> codes [..., 2 run]: the low nibbles in order, then the high."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """A little-endian uint32 of high bits [..., 4] -> bit i of it as code i's bit 4."""
    bits = np.ascontiguousarray(qh).view("<u4")[..., 0]
    return ((bits[..., None] >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of scales [..., 12] -> 8 six-bit scales and 8 mins."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc, mn


def from_gguf(blocks: np.ndarray, kind: str) -> GroupWeight:
    """Raw GGUF blocks of a weight, uint8 [N, K / block weights * block bytes], rows in
    the order wanted -> its codes, scales and offsets (the module docstring's forms)."""
    if kind not in BLOCKS:
        raise ValueError(f"GGUF type {kind} is not one of {', '.join(sorted(BLOCKS))}")
    size, per = BLOCKS[kind]
    n = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(n, -1, size)  # [N, blocks, bytes]
    offset = None
    if kind == "Q8_0":
        scale, q = _f16(b[..., 0:2]), b[..., 2:].view(np.int8)
    elif kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4
        q = _nibbles(b[..., head:], 16).astype(np.int8)
        scale = _f16(b[..., 0:2])
        if kind == "Q4_0":
            q = q - 8
        else:
            offset = _f16(b[..., 2:4])
    elif kind in ("Q5_0", "Q5_1"):
        head = 2 if kind == "Q5_0" else 4
        q = _nibbles(b[..., head + 4 :], 16) | (_high_bits(b[..., head : head + 4], 32) << 4)
        q = q.astype(np.int8)
        scale = _f16(b[..., 0:2])
        if kind == "Q5_0":
            q = q - 16
        else:
            offset = _f16(b[..., 2:4])
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])  # [N, blocks, 8]
        scale = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
        offset = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
        if kind == "Q4_K":
            qs = b[..., 16:].reshape(n, -1, 4, 32)  # 4 runs of 32 bytes: 64 weights each
            q = _nibbles(qs, 32)
        else:
            qh = b[..., 16:48].reshape(n, -1, 1, 32)  # bit j of byte i: weight 32 j + i
            qs = b[..., 48:].reshape(n, -1, 4, 32)
            high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
            q = _nibbles(qs, 32) | (high.reshape(n, -1, 4, 64) << 4)
        q = q.astype(np.int8)
    else:  # Q6_K: ql [128], qh [64], scales int8 [16], d fp16
        ql = b[..., 0:128].reshape(n, -1, 2, 1, 64)  # two halves of 128 weights
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[..., 208:210])
        low = ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)  # [.., 2, 2, 64]
        low = (low & 0x0F).reshape(n, -1, 2, 4, 32)
        high = qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        high = (high & 0x03).reshape(n, -1, 2, 4, 32)
        q = (low | (high << 4)).astype(np.int8) - 32
        scale = (d[..., None] * sc).reshape(n, -1)
    group = 16 if kind == "Q6_K" else 32
    codes = torch.from_numpy(np.ascontiguousarray(q).reshape(n, -1).astype(np.int8, copy=False))
    scale = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, -1))
    if offset is not None:
        offset = torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(n, -1))
    assert codes.shape[1] == b.shape[1] * per and scale.shape[1] * group == codes.shape[1]
    return GroupWeight(codes, scale, offset, group)


TILE = 16  # output rows a tile of group_matmul


@dataclass
class TiledGroupWeight:
    """A GroupWeight as Parley's group_matmul reads it (app/model/kernels/qmatmul.cpp): rows
    in tiles of 16 (padded with zero rows), per tile K / 4 chunks of the 16 rows' codes for
    4 k, scales and offsets [tiles, K / group, 16]. A code is stored in `bits` (the fewest
    of 4, 5, 6 or 8 that hold the weight's range of codes) and stands for the integer
    stored + `base` (8 bits: the int8 itself). Every choice of bits gives the same values,
    so the same results; fewer bits are fewer bytes to read."""

    codes: torch.Tensor  # uint8 [tiles, K / 4, 32 (4 bits), 40 (5) or 64]
    scale: torch.Tensor  # float32, or float16 where exact, [tiles, K / group, 16]
    offset: torch.Tensor | None  # like scale, None: zero
    group: int
    bits: int
    base: int
    num_rows: int  # N, before padding

    @classmethod
    def tile(cls, w: GroupWeight) -> TiledGroupWeight:
        n, k = w.shape
        lo, hi = (int(v) for v in torch.aminmax(w.codes)) if w.codes.numel() else (0, 0)
        bits = next(b for b in (4, 5, 6, 8) if hi - lo < 1 << b)
        base = 0 if bits == 8 else lo
        tiles = -(-n // TILE)
        width = {4: 32, 5: 40}.get(bits, 64)  # bytes a chunk (qmatmul.cpp's code_value)
        codes = np.zeros((tiles, k // 4, width), np.uint8)  # padded rows: code 0, scale 0
        src = w.codes.numpy().view(np.uint8)  # the int8's own bytes
        step = 256  # tiles a slab: a few MB of temporaries at a time, whatever the weight
        for t0 in range(0, tiles, step):
            rows = src[t0 * TILE : (t0 + step) * TILE]
            # code - base, in 0 .. 2^bits - 1: uint8 arithmetic wraps to it (bits 8: as is)
            q = rows - np.uint8(base % 256) if base else rows
            full = -(-len(q) // TILE) * TILE
            if full != len(q):
                q = np.concatenate([q, np.zeros((full - len(q), k), np.uint8)])
            t = q.reshape(-1, TILE, k // 4, 2, 2)  # (tile, row n, chunk c, half h, j)
            out = codes[t0 : t0 + len(t)]
            if bits in (4, 5):  # byte 2n + j of chunk c: h = 0 in the low nibble, h = 1 high
                low = t & 0x0F
                chunk = (low[:, :, :, 0, :] | (low[:, :, :, 1, :] << 4)).transpose(0, 2, 1, 3)
                out[..., :32] = chunk.reshape(len(t), k // 4, 32)
                if bits == 5:  # bit 32 h + 2n + j of the chunk's last 8 bytes: the fifth bit
                    fifth = (t >> 4).transpose(0, 2, 3, 1, 4).reshape(len(t), k // 4, 64)
                    out[..., 32:] = np.packbits(fifth, axis=-1, bitorder="little")
            else:  # bytes 32 h + 2n + j of chunk c
                out[...] = t.transpose(0, 2, 3, 1, 4).reshape(len(t), k // 4, 64)
        pad = tiles * TILE - n

        # fp16 where every scale and offset is one (Q8_0's, Q5_0's, ...: the file's own):
        # half their bytes, the same floats. K-quants' products d * sc need fp32.
        parts = [v for v in (w.scale, w.offset) if v is not None]
        half = all(torch.equal(v.half().float(), v) for v in parts)

        def tiled(v: torch.Tensor) -> torch.Tensor:
            v = torch.nn.functional.pad(v.float(), (0, 0, 0, pad))
            v = v.reshape(tiles, TILE, -1).transpose(1, 2)
            return (v.half() if half else v).contiguous()

        offset = None if w.offset is None else tiled(w.offset)
        return cls(torch.from_numpy(codes), tiled(w.scale), offset, w.group, bits, base, n)

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.codes.shape[1] * 4

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.offset) if t is not None)

    @property
    def is_q8_0(self) -> bool:
        """Q8_0's form, parley.q8_matmul's operand: 8-bit codes in groups of 32, fp16
        scales, no offsets."""
        held = (self.bits, self.group, self.offset, self.scale.dtype)
        return held == (8, 32, None, torch.float16)

    def row_codes(self, ids: torch.Tensor) -> torch.Tensor:
        """The integer codes of rows `ids` [T] -> int16 [T, K]."""
        tile, r = ids // TILE, ids % TILE
        _, k = self.shape
        if self.bits in (4, 5):
            nibbles = self.codes[..., :32].reshape(-1, k // 4, TILE, 2)
            b = nibbles[tile, :, r, :].to(torch.int16)  # [T, c, j]
            q = torch.stack((b & 0x0F, b >> 4), dim=2)  # [T, c, h, j]
            if self.bits == 5:  # the rows' tiles' bit planes, unpacked: [T, c, 64 bits]
                plane = self.codes[tile, :, 32:].numpy()
                bits = np.unpackbits(plane, axis=-1, bitorder="little")
                bits = bits.reshape(len(ids), k // 4, 2, TILE, 2)  # (row, c, h, n, j)
                fifth = bits[np.arange(len(ids)), :, :, r.numpy(), :]  # [T, c, h, j]
                q |= torch.from_numpy(fifth).to(torch.int16) << 4
        else:
            q = self.codes.view(-1, k // 4, 2, TILE, 2)[tile, :, :, r, :]  # [T, c, h, j]
            q = q.view(torch.int8) if self.bits == 8 else q
            q = q.to(torch.int16)
        return q.reshape(len(ids), k) + (0 if self.bits == 8 else self.base)

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` [T] -> [T, K], as the file's own dequantization gives them
        (GroupWeight.rows' arithmetic)."""
        tile, r = ids // TILE, ids % TILE
        t, k = len(ids), self.shape[1]
        w = self.row_codes(ids).view(t, k // self.group, self.group).float()
        w = w * self.scale[tile, :, r].float()[..., None]
        if self.offset is not None:
            w += self.offset[tile, :, r].float()[..., None]
        return w.view(t, k)


def group_matmul_available() -> bool:
    """Whether Parley's kernels (and so `parley.group_matmul`) are loaded."""
    return hasattr(torch.ops, "parley") and hasattr(torch.ops.parley, "group_matmul")


def int8_head_fits(w: TiledGroupWeight) -> bool:
    """Whether an LM head held as `w` runs on `parley.q8_matmul` (x as 8-bit codes per
    group of 32, integer dot products: qmatmul.cpp): a Q8_0 weight (8-bit codes, groups of
    32, fp16 scales, no offsets), kernels built with AVX-512 VNNI (elsewhere the same bits
    come from a portable loop, slower than group_matmul), and not PARLEY_INT8_HEAD=0."""
    return os.environ.get("PARLEY_INT8_HEAD", "1") != "0" and q8_native() and w.is_q8_0


def q8_native() -> bool:
    """Whether the loaded kernels run q8_matmul on AVX-512 VNNI (not its portable loop)."""
    return group_matmul_available() and torch.ops.parley.q8_native()


class GroupLinear(nn.Module):
    """y = x W^T + b, W a GroupWeight. On Parley's group_matmul where the kernels are
    loaded (x rounded to bf16, bf16 dot products accumulated in fp32 in a fixed order per
    element: a row's bits depend on nothing but its own x, on any CPU); elsewhere an fp32
    matmul over the dequantized weight (the same weights, more memory). The result comes
    back in x's dtype, or fp32 with `fp32_out` (an LM head). `int8_x` (a Q8_0 LM head, see
    int8_head_fits): on `parley.q8_matmul` instead, x as 8-bit codes per group of 32, the
    activations llama.cpp's kernels give the same file; again a row's bits are its own."""

    def __init__(
        self,
        weight: GroupWeight | TiledGroupWeight,
        bias: torch.Tensor | None = None,
        kernel: bool = True,
        fp32_out: bool = False,
        int8_x: bool = False,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group = weight.group
        self.bias = bias
        self.fp32_out = fp32_out
        self.kernel = kernel and group_matmul_available()
        self.int8_x = False
        if self.kernel:
            tiled = isinstance(weight, TiledGroupWeight)
            self.tiled = weight if tiled else TiledGroupWeight.tile(weight)
            self.weight_nbytes = self.tiled.nbytes
            if int8_x:
                if not self.tiled.is_q8_0:
                    raise ValueError("8-bit activations need a Q8_0 weight (parley.q8_matmul)")
                if not fp32_out:
                    raise ValueError("parley.q8_matmul gives fp32 (an LM head's logits)")
                self.int8_x = True
        else:
            gw = weight if isinstance(weight, GroupWeight) else None
            if gw is None:
                raise ValueError("a tiled weight needs Parley's group_matmul")
            self.dense = gw.dequantize()
            self.weight_nbytes = self.dense.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            w = self.tiled
            out = torch.float32 if self.fp32_out else x.dtype
            if self.int8_x:
                y = torch.ops.parley.q8_matmul(x.contiguous(), w.codes, w.scale)
            else:
                y = torch.ops.parley.group_matmul(
                    x.contiguous(), w.codes, w.scale, w.offset, w.group, w.bits, w.base, out
                )
            if y.shape[1] != self.out_features:  # rows padded to whole tiles
                y = y[:, : self.out_features].contiguous()
        else:
            y = torch.nn.functional.linear(x.float(), self.dense)
            if not self.fp32_out:
                y = y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        on = "fp32 dequantized"
        if self.kernel:
            on = f"Parley's group_matmul ({self.tiled.bits}-bit codes)"
            if self.int8_x:
                on = "Parley's q8_matmul (8-bit codes, x as 8-bit codes)"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"groups of {self.group} on {on}"
        )


class GroupEmbedding(nn.Module):
    """Token embeddings looked up in a GroupWeight's rows (or a TiledGroupWeight's, the LM
    head's bytes where the two are tied), in `dtype`: each row as the file's dequantization
    gives it in fp32, rounded to `dtype` once."""

    def __init__(self, weight: GroupWeight | TiledGroupWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.gw = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        if isinstance(weight, TiledGroupWeight):
            self.weight_nbytes = weight.nbytes
        else:
            self.weight_nbytes = weight.codes.nbytes + weight.scale.nbytes
            self.weight_nbytes += 0 if weight.offset is None else weight.offset.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gw, TiledGroupWeight):
            return self.gw.rows_of(ids).to(self.dtype)
        return self.gw.rows(ids).to(self.dtype)
