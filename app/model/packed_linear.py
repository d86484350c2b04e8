"""Linear layers with weights prepacked for oneDNN on x86 CPUs.

PyTorch's default CPU matmul (MKL sgemm) re-reads a plain row-major weight on every
call. oneDNN can instead keep the weight in its own blocked layout, reordered once at
load, and then streams it much better for the small row counts of decode: measured here
(2 cores, AVX-512) the model's linears take ~1.5x less time at 1-64 rows, fp32 throughout
(differences vs sgemm ~1e-6, accumulation order). The kernel is the one PyTorch's own
compiler (inductor) emits for CPU linears; we call it directly. Where it is missing
(other builds, other devices) layers stay plain nn.Linear. Row counts are rounded up to a
few buckets (see `bucket`) so that oneDNN's per-shape kernel cache stays small.
"""

from __future__ import annotations

import torch
from torch import nn

from app.model import cpu


def bucket(rows: int) -> int:
    """The row count a matmul actually runs with. oneDNN builds and caches a kernel per
    shape, ~0.6 MB each: left alone, a server that sees every row count from 1 to 2,048
    grows by hundreds of MB. Rounding rows up to ~30 sizes bounds that, for a few percent
    of padding (small batches are bound by reading weights, so 3 rows cost what 4 do)."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()  # 1, 2, 4, 8
    for limit, step in ((64, 8), (128, 16), (512, 64)):
        if rows <= limit:
            return -(-rows // step) * step
    return -(-rows // 256) * 256


def packing_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's layout (opaque: it cannot be indexed)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().contiguous()
        # The batch-size hint picks the blocked format; 16-64 measured best for 1-64 rows
        # (1 was ~30% slower at 8-32 rows).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.weight_nbytes = weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = bucket(rows)
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y[:rows] if padded != rows else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def packable(dtype: torch.dtype) -> bool:
    """fp32 always; bf16 where oneDNN has native bf16 kernels (AVX-512 BF16 / AMX). oneDNN
    also accepts bf16 on AVX-512 CPUs without BF16, by emulation: not worth packing."""
    if dtype == torch.bfloat16:
        return cpu.cpu_has_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack_linears(module: nn.Module) -> int:
    """Replace every packable nn.Linear inside `module` by a PackedLinear. Returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and packable(child.weight.dtype):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count


def pack_weight(weight: torch.Tensor) -> PackedLinear:
    """A PackedLinear over a bare weight (e.g. an LM head tied to the embedding)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return PackedLinear(linear)
