"""Gemma 3 (Gemma Team 2025) over Llama's shared layers: transformers' modeling_gemma3.py
is the numerical reference.

What differs from Llama's decoder:
- the embedding is scaled by sqrt(hidden size);
- each head's q and k are RMS-normalized before the rotary (as in Qwen3);
- "sandwich" norms: the attention's output and the MLP's are normalized before they join
  the residual stream, besides the norms before each;
- RMSNorm scales by 1 + w (app.model.families.layer_norms folds the 1 into our weights);
- the MLP's activation is GELU (tanh approximation);
- five of every six layers attend locally (the last `local_window` positions, rotary base
  rope_local_theta); each sixth attends to everything (rotary base rope_theta).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.model.arch import ArchConfig
from app.model.attention import AttentionMetadata, attend
from app.model.families.qwen3 import qk_normed_attention_inputs
from app.model.llama import DecoderLayer, LlamaModel, RMSNorm, Rotary
from app.model.sliding_window import attend_window

# Gemma's turn format, for files that carry no template of their own (the base 270M does
# not): turns of "user" and "model" between <start_of_turn> and <end_of_turn>. Gemma has
# no system role: system messages open the first user turn, a blank line after them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + m['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if role == 'user' and ns.system -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ m['content'] }}{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.system -%}{{ '<start_of_turn>user\n' + ns.system + '<end_of_turn>\n' }}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


class Gemma3Layer(DecoderLayer):
    def __init__(
        self, arch: ArchConfig, layer: int, device: torch.device | str | None = None
    ) -> None:
        super().__init__(arch, device)
        eps = arch.rms_norm_eps
        self.q_norm = RMSNorm(arch.head_dim, eps, device)
        self.k_norm = RMSNorm(arch.head_dim, eps, device)
        self.attn_out_norm = RMSNorm(arch.hidden_size, eps, device)
        self.mlp_out_norm = RMSNorm(arch.hidden_size, eps, device)
        self.window = arch.layer_window(layer)

    def forward(  # type: ignore[override]
        self,
        h: torch.Tensor,  # (T, hidden)
        residual: torch.Tensor | None,
        rope: object,  # the local or global rotary's, as this layer attends
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        positions: torch.Tensor,  # (T,)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops = self.arch, self.ops
        T = h.shape[0]
        q, k, v, residual = qk_normed_attention_inputs(self, h, residual, rope, kv, meta)
        if self.window is None:
            o = attend(q, k, v, kv[0], kv[1], meta, self.scale)
        else:
            o = attend_window(q, k, v, kv[0], kv[1], meta, self.scale, self.window, positions)
        o = ops.norm(self.o_proj(o.reshape(T, a.q_size)), self.attn_out_norm)
        x, residual = ops.add_norm(o, residual, self.post_norm)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        y = self.down(F.gelu(gate, approximate="tanh") * up)
        return ops.norm(y, self.mlp_out_norm), residual


class Gemma3Model(LlamaModel):
    """The Gemma 3 decoder on the engine's flat batches (LlamaModel's interface)."""

    stackable = False  # its decode stack is decode_layers_normed's
    gelu = True

    def __init__(
        self,
        arch: ArchConfig,
        max_positions: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(arch, max_positions, dtype, device)
        self.layers = nn.ModuleList(Gemma3Layer(arch, i, device) for i in range(arch.num_layers))
        local = ArchConfig.from_dict(
            arch.to_dict() | {"rope_theta": arch.rope_local_theta or arch.rope_theta}
        )
        self.rotary_local = Rotary(local, max_positions).to(dtype)
        # transformers keeps sqrt(hidden) in the model's dtype and multiplies by that.
        self.embed_scale = float(torch.tensor(arch.hidden_size**0.5, dtype=dtype))

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # (S,)
    ) -> torch.Tensor:
        """Returns logits (S, vocab)."""
        h = self.embed_tokens(input_ids)
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        residual = None
        ropes = {
            False: self.ops.rope(self.rotary, positions),
            True: self.ops.rope(self.rotary_local, positions),
        }
        stacked = self.ops.decode_normed_layers(self, h, ropes[False], ropes[True], kv_caches, meta)
        if stacked is not None:
            h, residual = stacked
        else:
            for layer, kv in zip(self.layers, kv_caches, strict=True):
                rope = ropes[layer.window is not None]
                h, residual = layer(h, residual, rope, kv, meta, positions)
        h = self.ops.norm((residual + h)[logits_indices], self.norm)
        if self.packed_lm_head is not None:
            return self.packed_lm_head(h)
        return F.linear(h, self.lm_head_weight).float()
