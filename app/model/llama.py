"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

The architecture is Llama's (Touvron et al. 2023): pre-norm RMSNorm, rotary position
embeddings, grouped-query attention, a SwiGLU MLP. transformers' `modeling_llama.py` is
the numerical reference (tests compare logits); the difference is the batch: not a padded
[B, T] tensor but one flat run of T tokens from many sequences, with positions and
AttentionMetadata saying where each token's K/V lives and what it attends to.

Q, K and V share one matrix (`qkv`), and so do the MLP's gate and up projections
(`gate_up`): on a CPU a decode step is bound by reading weights, and fewer, larger
matmuls read them faster and cost fewer Python calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from app.model.arch import ArchConfig
from app.model.attention import AttentionMetadata, PrefillChunk, attend, store_kv
from app.model.attention_backends import AttentionBackend, CpuKernelBackend, SdpaBackend
from app.model.packed_linear import pack_linears, pack_weight, packable, packing_available


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight.

    Measured and not kept: the same as one LayerNorm kernel over [x, -x] (mean 0,
    variance mean(x^2)). At decode it took 9 against 16 us a call (F.rms_norm is eight
    small ops on the CPU), ~0.3 ms a step, but in bf16 it rounded 30% of the real model's
    rows differently, and a served reply's logprobs then parted from a prefill's by more
    than bf16's usual margin (tests/server/openai/test_features.py)."""

    def __init__(self, dim: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rotary_inv_freq(arch: ArchConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with the config's scaling applied."""
    d = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "freq_factors":  # llama.cpp's form: each frequency divided by its own factor
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
        # band between them interpolated smoothly.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, scaled, inv_freq)
    return inv_freq


class Rotary(nn.Module):
    """Rotary embeddings in the "rotate half" layout of Hugging Face checkpoints:
    dimension i pairs with i + head_dim/2.

    The tables are full width with the sign folded in, cos = [c, c] and sin = [-s, s], so
    that a rotation is x * cos + roll(x, D/2) * sin: four tensor ops per layer instead of
    eleven, with products and sums rounded exactly as in x1 c - x2 s, x2 c + x1 s. A step
    looks its positions up once (`at`) and every layer reuses them."""

    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, rotary_inv_freq(arch))  # (P, D/2)
        cos, sin = freqs.cos().float(), freqs.sin().float()
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)  # (P, D)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's position, (T, 1, D), for `rotate`."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: (T, heads, D) -> same, rotated by the positions `cos_sin` was looked up at."""
        cos, sin = cos_sin
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class TorchOps:
    """A layer's small ops as PyTorch ops: the reference, on any device.

    Three seams, after vLLM's fused_add_rms_norm and its rotary + cache-write kernels:
    `norm` and `add_norm` (the residual stream's add fused into the norm that reads it),
    and `rope_store` (q and k rotated, k and v written to their cache slots). `rope`
    prepares, once a step, what `rope_store` needs of the positions."""

    fused = False
    prefill_in_place = False  # prompts attend through PyTorch's SDPA (attention.py)

    def attention(self, block_size: int, query_groups: int, dtype: torch.dtype) -> AttentionBackend:
        """The attention path these ops run on, which builds each step's metadata."""
        return SdpaBackend(block_size, query_groups, dtype)

    def rope(self, rotary: Rotary, positions: torch.Tensor) -> object:
        return rotary.at(positions)

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x)."""
        residual = residual + x
        return norm(residual), residual

    def decode_layers(
        self, model: LlamaModel, h: torch.Tensor, rope: object,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """The whole layer stack in one call, where the ops can; None: layer by layer."""
        return None

    def decode_normed_layers(
        self, model: LlamaModel, h: torch.Tensor, rope: object, local_rope: object,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """decode_layers for a family with q/k norms (app/model/families), `local_rope` the
        local layers' rotary; None: layer by layer."""
        return None

    def rope_store(
        self, qkv: torch.Tensor, rope: object, kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, arch: ArchConfig,
    ) -> torch.Tensor:  # fmt: skip
        """q and k rotated, (T, H + Hkv, D); k and v stored in the cache."""
        T, D = qkv.shape[0], arch.head_dim
        # Rotate q and k together: they are adjacent in the fused projection.
        qk = Rotary.rotate(qkv[:, : arch.q_size + arch.kv_size].view(T, -1, D), rope)
        v = qkv[:, arch.q_size + arch.kv_size :].view(T, arch.num_kv_heads, D)
        store_kv(qk[:, arch.num_heads :], v, kv[0], kv[1], meta.slot_mapping)
        return qk


class FusedCpuOps(TorchOps):
    """The same ops as Parley's CPU kernels (app/model/kernels): one call each instead of
    2-11 tensor ops, rounding as they do but for the order of the norm's sum (bf16: the
    same bits in all but ~1 in 10^5 values; fp32: within 2 ulp). Decode attention reads
    the cache in place too (AttentionMetadata.decode_lens), and so does prompt attention
    where `prefill_in_place` (AttentionMetadata.prefill_in_place: app/model/build.py
    chooses it where the CPU has AVX-512)."""

    fused = True

    def __init__(
        self,
        prefill_in_place: bool = True,
        layer_weights: Callable[[LlamaModel], list[torch.Tensor]] | None = None,
        normed_weights: Callable[[LlamaModel], tuple | None] | None = None,
    ) -> None:
        self.prefill_in_place = prefill_in_place
        # What decode_layers reads of the model (quant/int4.py: decode_layers_weights), or
        # None: these weights have no one-call stack, layers go one by one.
        self._layer_weights = layer_weights
        self._weights: list[torch.Tensor] | None = None  # decode_layers' flat list, once
        # The same for decode_layers_normed (quant.int4: normed_layers_weights), read once.
        self._normed_weights = normed_weights
        self._normed: tuple | bool | None = False  # False: not read yet

    @staticmethod
    def _decode_only(h: torch.Tensor, meta: AttentionMetadata) -> bool:
        return not meta.prefills and meta.decode_lens is not None and meta.num_decodes == h.shape[0]

    def attention(self, block_size: int, query_groups: int, dtype: torch.dtype) -> AttentionBackend:
        return CpuKernelBackend(block_size, query_groups, dtype, self.prefill_in_place)

    def rope(self, rotary: Rotary, positions: torch.Tensor) -> object:
        return rotary.cos, rotary.sin, positions

    def decode_layers(
        self, model: LlamaModel, h: torch.Tensor, rope: object,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """A decode-only step over int4 weights runs the layers in one C++ call: the same
        ops in the same order as layer by layer, without their ~15 Python calls a layer."""
        if not self._decode_only(h, meta):
            return None
        if not model.stackable:  # a family's own layers (app/model/families)
            return None
        if self._weights is None:
            self._weights = self._layer_weights(model) if self._layer_weights else []
        if not self._weights:
            return None
        cos, sin, positions = rope  # type: ignore[misc]
        a = model.arch
        return torch.ops.parley.decode_layers(
            h, cos, sin, positions, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_lens, [k for k, _ in kv_caches], [v for _, v in kv_caches],
            self._weights, a.num_heads, a.num_kv_heads, a.rms_norm_eps,
            a.head_dim**-0.5,
        )  # fmt: skip

    def decode_normed_layers(
        self, model: LlamaModel, h: torch.Tensor, rope: object, local_rope: object,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """A decode-only step of a family with q/k norms in one C++ call, where every linear
        runs on Parley's int4 or group kernels: the same ops in the same order as its Python
        layers (app/model/families), so the same bits."""
        if not self._decode_only(h, meta):
            return None
        if self._normed is False:
            self._normed = self._normed_weights(model) if self._normed_weights else None
        if self._normed is None:
            return None
        linears, kinds, norms, windows = self._normed  # type: ignore[misc]
        cos, sin, positions = rope  # type: ignore[misc]
        local_cos, local_sin, _ = local_rope  # type: ignore[misc]
        a = model.arch
        return torch.ops.parley.decode_layers_normed(
            h, cos, sin, local_cos, local_sin, positions, meta.slot_mapping,
            meta.decode_block_tables, meta.decode_lens, [k for k, _ in kv_caches],
            [v for _, v in kv_caches], linears, kinds, norms, windows, a.num_heads,
            a.num_kv_heads, a.rms_norm_eps, model.layers[0].scale, len(norms) > 4 * len(windows),
            model.gelu,
        )  # fmt: skip

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return torch.ops.parley.rms_norm(x, norm.weight, norm.eps)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.parley.add_rms_norm(x, residual, norm.weight, norm.eps)

    def rope_store(
        self, qkv: torch.Tensor, rope: object, kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, arch: ArchConfig,
    ) -> torch.Tensor:  # fmt: skip
        cos, sin, positions = rope  # type: ignore[misc]
        return torch.ops.parley.rope_store(
            qkv, cos, sin, positions, meta.slot_mapping, kv[0], kv[1],
            arch.num_heads, arch.num_kv_heads,
        )  # fmt: skip


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device)
        self.qkv = nn.Linear(
            arch.hidden_size, arch.q_size + 2 * arch.kv_size, arch.attention_bias, device
        )
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, False, device)
        self.post_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device)
        self.gate_up = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, False, device)
        self.down = nn.Linear(arch.intermediate_size, arch.hidden_size, False, device)
        self.scale = arch.head_dim**-0.5
        self.ops = TorchOps()

    def forward(
        self,
        h: torch.Tensor,  # (T, hidden): the previous layer's output, or the embeddings
        residual: torch.Tensor | None,  # (T, hidden): the stream h adds to; None at layer 0
        rope: object,  # ops.rope(...) of the step's positions
        kv: tuple[torch.Tensor, torch.Tensor],  # each (num_blocks, block_size, Hkv, D)
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream it adds to): the sum is left
        to the next norm, which does it in the same pass."""
        a, ops = self.arch, self.ops
        T = h.shape[0]
        if residual is None:
            x, residual = ops.norm(h, self.input_norm), h
        else:
            x, residual = ops.add_norm(h, residual, self.input_norm)
        qkv = self.qkv(x)  # (T, (H + 2 Hkv) * D)
        qk = ops.rope_store(qkv, rope, kv, meta, a)
        q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        v = qkv[:, a.q_size + a.kv_size :].view(T, a.num_kv_heads, a.head_dim)
        o = attend(q, k, v, kv[0], kv[1], meta, self.scale)  # (T, H, D)
        x, residual = ops.add_norm(self.o_proj(o.view(T, a.q_size)), residual, self.post_norm)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up), residual


class LlamaModel(nn.Module):
    """The decoder. forward() takes a flat batch and returns logits only for the rows in
    `logits_indices` (the LM head is the largest matmul of a small model: it never runs
    for tokens in the middle of a prompt)."""

    stackable = True  # its layers are Llama's own, which Parley's decode_layers computes
    gelu = False  # the MLP's activation: SiLU (GELU, tanh approximation, where True)

    def __init__(
        self,
        arch: ArchConfig,
        max_positions: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        """The parameters on `device` ("meta" for a skeleton whose weights are then assigned
        from a checkpoint); the rotary tables, computed rather than loaded, in `dtype` on the
        CPU. The meta device is passed, not set as a default (`with torch.device("meta")`):
        under that mode, random init and arange reach PyTorch's Python references, whose
        import (torch._dynamo) holds ~150 MiB of memory for the process's life."""
        super().__init__()
        self.arch = arch
        # Given a weight, the embedding skips its random init (normal_, which imports the
        # same references); the checkpoint's replaces it.
        table = torch.empty(arch.vocab_size, arch.hidden_size, device=device)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(arch, device) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device)
        self.lm_head = (
            None
            if arch.tie_word_embeddings
            else nn.Linear(arch.hidden_size, arch.vocab_size, False, device)
        )
        self.rotary = Rotary(arch, max_positions).to(dtype)
        self.packed_lm_head: nn.Module | None = None
        self.ops: TorchOps = TorchOps()

    def use_ops(self, ops: TorchOps) -> None:
        """Run every layer's small ops as `ops` (FusedCpuOps once the kernels are loaded)."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = ops

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_for_cpu(self) -> bool:
        """Prepack every linear layer, LM head included, for oneDNN (see packed_linear).
        The embedding stays plain: a tied LM head gets its own packed copy. fp32, and bf16
        where the CPU has bf16 kernels; other weights run as they are."""
        if not packing_available() or not packable(self.embed_tokens.weight.dtype):
            return False
        self.packed_lm_head = pack_weight(self.lm_head_weight.detach())
        self.lm_head = None
        pack_linears(self.layers)
        # What stays plain (embedding, norms) may still live in the memory-mapped weights
        # file; owning a copy lets the mapping go, so its pages leave our RSS.
        for param in self.parameters():
            param.data = param.data.clone()
        return True

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (K, V) per layer
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # (S,) rows of the flat batch that sample
    ) -> torch.Tensor:
        """Returns logits (S, vocab)."""
        h, residual = self.embed_tokens(input_ids), None
        rope = self.ops.rope(self.rotary, positions)
        stacked = self._decode_stack(h, rope, kv_caches, meta)
        if stacked is not None:
            h, residual = stacked
        else:
            for layer, kv in zip(self.layers, kv_caches, strict=True):
                h, residual = layer(h, residual, rope, kv, meta)
        h = self.ops.norm((residual + h)[logits_indices], self.norm)
        if self.packed_lm_head is not None:
            return self.packed_lm_head(h)
        return F.linear(h, self.lm_head_weight).float()  # the sampler works in fp32

    def _decode_stack(
        self, h: torch.Tensor, rope: object,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """The layers in one call where the ops can (a family's own: decode_normed_layers)."""
        return self.ops.decode_layers(self, h, rope, kv_caches, meta)

    def forward_tokens(self, ids: list[int], logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """One causal pass over `ids` outside the engine, with a scratch K/V cache of its
        own: logits at the positions `logits_at` (default: every position). For
        calibration and measurements such as perplexity."""
        n, arch, block = len(ids), self.arch, 16
        shape = (-(-n // block) + 1, block, arch.num_kv_heads, arch.head_dim)
        dtype, device = self.norm.weight.dtype, self.norm.weight.device
        caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(arch.num_layers)
        ]
        positions = torch.arange(n, device=device)
        # The engine's path, as its attention backend builds it: block 0 stays unused.
        backend = self.ops.attention(block, arch.num_heads // arch.num_kv_heads, dtype)
        meta = backend.metadata(num_decodes=0)
        meta.slot_mapping = positions + block
        backend.add_prefill(meta, PrefillChunk(0, n, n, None, None), list(range(1, shape[0])))
        logits_at = positions if logits_at is None else logits_at.to(device)
        return self(torch.tensor(ids, device=device), positions, caches, meta, logits_at)

    @classmethod
    def from_weights(
        cls, arch: ArchConfig, weights: dict[str, torch.Tensor], max_positions: int
    ) -> LlamaModel:
        """Build on the meta device, then adopt the loaded tensors without copying.
        The rotary tables compute in the weights' dtype."""
        dtype = weights["embed_tokens.weight"].dtype
        model = cls(arch, max_positions, dtype, device="meta")
        model.load_state_dict(weights, strict=True, assign=True)
        return model.eval().requires_grad_(False)
