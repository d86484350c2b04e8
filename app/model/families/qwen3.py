"""Qwen3: Llama's decoder with an RMSNorm over each head's q and k before the rotary
(transformers' modeling_qwen3.py is the reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.model.arch import ArchConfig
from app.model.attention import AttentionMetadata, attend
from app.model.llama import DecoderLayer, LlamaModel, RMSNorm, TorchOps


def qk_normed(
    qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, ops: TorchOps, arch: ArchConfig
) -> torch.Tensor:
    """qkv (T, (H + 2 Hkv) D) with each head of q and k RMS-normalized over its D."""
    T, D = qkv.shape[0], arch.head_dim
    # (T * heads, D) rows, contiguous: a slice of one head's width reshapes to a strided view.
    q = ops.norm(qkv[:, : arch.q_size].reshape(-1, D).contiguous(), q_norm).view(T, -1)
    k = qkv[:, arch.q_size : arch.q_size + arch.kv_size].reshape(-1, D).contiguous()
    k = ops.norm(k, k_norm)
    return torch.cat((q, k.view(T, -1), qkv[:, arch.q_size + arch.kv_size :]), dim=-1)


def qk_normed_attention_inputs(
    layer: DecoderLayer,
    h: torch.Tensor,
    residual: torch.Tensor | None,
    rope: object,
    kv: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer with q/k norms up to attention: the input norm (added to the residual), the
    projection with each head of q and k normalized, the rotary with K/V stored; returns
    q, k, v as (T, heads, D) and the residual."""
    a, ops = layer.arch, layer.ops
    T = h.shape[0]
    if residual is None:
        x, residual = ops.norm(h, layer.input_norm), h
    else:
        x, residual = ops.add_norm(h, residual, layer.input_norm)
    qkv = qk_normed(layer.qkv(x), layer.q_norm, layer.k_norm, ops, a)
    qk = ops.rope_store(qkv, rope, kv, meta, a)
    v = qkv[:, a.q_size + a.kv_size :].view(T, a.num_kv_heads, a.head_dim)
    return qk[:, : a.num_heads], qk[:, a.num_heads :], v, residual


class Qwen3Layer(DecoderLayer):
    def __init__(self, arch: ArchConfig, device: torch.device | str | None = None) -> None:
        super().__init__(arch, device)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, device)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, device)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: object,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops = self.arch, self.ops
        T = h.shape[0]
        q, k, v, residual = qk_normed_attention_inputs(self, h, residual, rope, kv, meta)
        o = attend(q, k, v, kv[0], kv[1], meta, self.scale)
        x, residual = ops.add_norm(self.o_proj(o.reshape(T, a.q_size)), residual, self.post_norm)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up), residual


class Qwen3Model(LlamaModel):
    """Llama's decoder over Qwen3Layers: a decode step's stack in one call is
    decode_layers_normed's (Llama's decode_layers knows Llama's layer only)."""

    stackable = False

    def __init__(
        self,
        arch: ArchConfig,
        max_positions: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(arch, max_positions, dtype, device)
        self.layers = torch.nn.ModuleList(Qwen3Layer(arch, device) for _ in range(arch.num_layers))

    def _decode_stack(
        self, h: torch.Tensor, rope: object,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        return self.ops.decode_normed_layers(self, h, rope, rope, kv_caches, meta)
