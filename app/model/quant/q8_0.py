"""The LM head and the embedding from GGUF's Q8_0 bytes as stored.

Q8_0 keeps 32 weights a block as int8 codes and one fp16 scale, w = d * q: 8.5 bits a
weight, half the bytes of bf16. The LM head is the largest matmul of a small model (the
default model's tied head is 49,152 x 576, 40% of a decode step's bytes as bf16), so it is
read from these bytes directly, and d * q is exact in fp32: no rounding of the weights at
all (bf16 rounded them to 8 bits of precision). The embedding looks up the same bytes, so
one copy serves both where the checkpoint ties them.

Where activations are bf16 the head runs on `parley.group_matmul` (app/model/quant/kquants.py,
bf16 dot products); with fp32 activations (a CPU without native bf16) on
`parley.block_matmul` (app/model/kernels/matmul.cpp), here, which keeps x in fp32.

Why the LM head runs on our kernels even for float weights: a token's logits must be the
same bits whether it is decoded alone, scored among hundreds of prompt rows, or computed on
one thread or two; oneDNN's kernel choice depends on the CPU and the row count, and on
some CPUs one row and many differ (see matmul.cpp). The kernels return fp32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

BLOCK = 32  # weights per scale
_BLOCK_BYTES = 2 + BLOCK  # fp16 scale, then 32 int8 codes


@dataclass
class Q8Weight:
    """A weight [N, K] as int8 codes with one fp32 scale per BLOCK along K:
    w[n, k] = codes[n, k] * scale[n, k // BLOCK]."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / BLOCK]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], exact (an 11-bit scale times an 8-bit code fits fp32's 24 bits)."""
        n, k = self.shape
        return (self.codes.view(n, k // BLOCK, BLOCK).float() * self.scale[..., None]).view(n, k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` [T] -> [T, K], exact."""
        codes, scale = self.codes[ids], self.scale[ids]
        t, k = codes.shape
        return (codes.view(t, k // BLOCK, BLOCK).float() * scale[..., None]).view(t, k)

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.codes": self.codes, f"{prefix}.scale": self.scale}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], prefix: str) -> Q8Weight | None:
        if f"{prefix}.codes" not in state:
            return None
        return cls(state.pop(f"{prefix}.codes"), state.pop(f"{prefix}.scale"))


def from_gguf_q8_0(blocks: np.ndarray) -> Q8Weight:
    """Raw GGUF Q8_0 blocks of a weight, uint8 [N, K / 32 * 34] -> the same codes and
    scales (a block: d as fp16, then 32 int8 codes in order)."""
    n = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(n, -1, _BLOCK_BYTES)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:].copy().view(np.int8).reshape(n, -1)
    return Q8Weight(torch.from_numpy(q), torch.from_numpy(d))


def block_matmul_available() -> bool:
    """Whether Parley's kernels (and so `parley.block_matmul`) are loaded."""
    return hasattr(torch.ops, "parley") and hasattr(torch.ops.parley, "block_matmul")


class BlockLinear(nn.Module):
    """y = x W^T in fp32 through `parley.block_matmul`, W as Q8_0 codes and scales or as
    float rows (bf16 / fp32). Each output element's arithmetic is fixed by K alone."""

    def __init__(self, weight: Q8Weight | torch.Tensor) -> None:
        super().__init__()
        if isinstance(weight, Q8Weight):
            self.weight, self.scale = weight.codes.contiguous(), weight.scale.contiguous()
        else:
            self.weight, self.scale = weight.detach().contiguous(), None
        self.out_features, self.in_features = self.weight.shape
        self.weight_nbytes = self.weight.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.parley.block_matmul(x.contiguous(), self.weight, self.scale)

    def extra_repr(self) -> str:
        kind = "q8_0" if self.scale is not None else str(self.weight.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class Q8Embedding(nn.Module):
    """Token embeddings looked up in Q8_0 rows, in `dtype` (as a float table in that dtype
    would hold them: each row d * q, exact in fp32, rounded to `dtype` once)."""

    def __init__(self, weight: Q8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.q8 = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight_nbytes = weight.codes.nbytes + weight.scale.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q8.rows(ids).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q8_0 as {self.dtype}"
