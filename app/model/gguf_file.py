"""Read a GGUF file (llama.cpp's format) into an ArchConfig and Hugging Face-named float
tensors, with the `gguf` package alone (transformers' GGUF path is ~10x slower).

The 4-bit blocks of Q4_0 / Q4_1 tensors can also be read as they are (`iter_q4_weights`),
for the int4 weight format (app.model.quant.int4), and so can Q8_0 tensors
(`iter_q8_weights`: the embedding and LM head, app.model.quant.q8_0) and every other block
format (`iter_group_weights`: K-quants, Q5_0/Q5_1, Q8_0 linears, app.model.quant.kquants).

Two traps:
- GGUF stores shapes innermost-first; `gguf` gives numpy arrays already in PyTorch's
  [out_features, in_features] order once dequantized.
- For the llama architecture, llama.cpp's converter permutes the rows of the Q and K
  projections to suit its rotary layout (pairs (2i, 2i+1) instead of halves (i, i+d/2)).
  Hugging Face weights are not permuted, nor is our rotary code: undo it here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from app.model.arch import ArchConfig
from app.model.quant.int4 import Int4Weight, from_gguf_q4
from app.model.quant.kquants import GROUP_TYPES, GroupWeight, from_gguf
from app.model.quant.q8_0 import Q8Weight, from_gguf_q8_0
from app.model.registry import SUPPORTED_ARCHITECTURES

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma's sandwich norms: llama.cpp's ffn_norm is its pre-feedforward norm, and its
# post-attention norm normalizes the attention's output.
_GEMMA_NAMES = _LAYER_NAMES | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3 stores q/k/v as one matrix and gate/up as another (ffn_up: gate's rows, then up's).
_PHI3_NAMES = _LAYER_NAMES | {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# llama.cpp hard-codes what gemma3's GGUF metadata leaves out: every 6th layer attends
# globally, the others locally with rotary base 10,000.
GEMMA3_GLOBAL_EVERY, GEMMA3_LOCAL_THETA = 6, 10000.0
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


ROPE_FREQS = "rope_freqs.weight"


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        return f.contents()
    return f.contents()


def read_arch(reader: GGUFReader) -> ArchConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = _rope_scaling(reader, get("rope.scaling.type"), get("rope.scaling.factor"))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    if any(t.name.startswith("rope_factors_") for t in reader.tensors):
        raise ValueError(f"{arch}: LongRoPE (rope_factors_long/short tensors) is not supported")
    window = get("attention.sliding_window")
    window = int(window) if window else None
    gemma = arch == "gemma3"
    return ArchConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=tied,
        attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        rope_scaling=rope_scaling,
        sliding_window=None if gemma else window,
        qk_norm=any(t.name.endswith("attn_q_norm.weight") for t in reader.tensors),
        local_window=window if gemma else None,
        global_every=GEMMA3_GLOBAL_EVERY if gemma else 0,
        rope_local_theta=GEMMA3_LOCAL_THETA if gemma else None,
    )


def _rope_scaling(
    reader: GGUFReader, scaling_type: str | None, factor: float | None
) -> dict[str, Any] | None:
    """llama.cpp's converter stores Llama 3's scaling not as metadata but as a tensor,
    `rope_freqs`: rotary frequency i is divided by rope_freqs[i]. A linear factor, if
    any, divides every frequency too, so the two fold into one list of divisors."""
    if scaling_type not in (None, "none", "linear"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
    linear = float(factor) if scaling_type == "linear" else 1.0
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        factors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
        return {"rope_type": "freq_factors", "factors": [float(f) * linear for f in factors]}
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": linear}
    return None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation (works for weights and biases).

    llama.cpp maps, within each head, row (half h, index i) to row (i, h): viewed as
    (heads, 2, d/2) -> swap -> (heads, d/2, 2). Undoing it reads rows as (heads, d/2, 2).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {"gemma3": _GEMMA_NAMES, "phi3": _PHI3_NAMES}.get(architecture, _LAYER_NAMES)
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None  # e.g. rope_freqs: read into ArchConfig.rope_scaling instead


def _in_our_row_order(w: np.ndarray, name: str, arch: ArchConfig) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation. It moves whole rows, so it applies alike to float
    rows and to rows of raw quantized blocks."""
    if arch.architecture not in ("llama", "mistral"):
        return w
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute(w, arch.num_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute(w, arch.num_kv_heads)
    return w


def iter_tensors(reader: GGUFReader, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor) for every weight, dequantizing as we go."""
    for t in reader.tensors:
        name = hf_name(t.name, arch.architecture)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        w = np.ascontiguousarray(_in_our_row_order(w, name, arch))
        if arch.architecture == "gemma3" and name.endswith("norm.weight"):
            # llama.cpp stores Gemma's norm weights as 1 + w (Gemma normalizes by 1 + w);
            # Hugging Face names mean Hugging Face values, as transformers' reader does.
            w = w - np.float32(1)
        yield name, torch.from_numpy(w if w.flags.writeable else w.copy())


def tensor_types(reader: GGUFReader, architecture: str = "llama") -> dict[str, str]:
    """Hugging Face name -> the GGUF type it is stored as ("Q4_1", "Q8_0", "F32", ...)."""
    return {
        name: t.tensor_type.name
        for t in reader.tensors
        if (name := hf_name(t.name, architecture)) is not None
    }


Q4_TYPES = ("Q4_0", "Q4_1")


def iter_q4_weights(reader: GGUFReader, arch: ArchConfig) -> Iterator[tuple[str, Int4Weight]]:
    """Yield (Hugging Face name, codes and scales bit for bit) for every Q4_0 / Q4_1 matrix."""
    for t in reader.tensors:
        name = hf_name(t.name, arch.architecture)
        if name is None or t.tensor_type.name not in Q4_TYPES or len(t.shape) != 2:
            continue
        blocks = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # [rows, block bytes]
        yield name, from_gguf_q4(_in_our_row_order(blocks, name, arch), t.tensor_type.name)


def iter_q8_weights(reader: GGUFReader, arch: ArchConfig) -> Iterator[tuple[str, Q8Weight]]:
    """Yield (Hugging Face name, codes and scales as stored) for every Q8_0 matrix."""
    for t in reader.tensors:
        name = hf_name(t.name, arch.architecture)
        if name is None or t.tensor_type.name != "Q8_0" or len(t.shape) != 2:
            continue
        blocks = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # [rows, block bytes]
        yield name, from_gguf_q8_0(_in_our_row_order(blocks, name, arch))


def iter_group_weights(
    reader: GGUFReader, arch: ArchConfig, names: frozenset[str] | None = None
) -> Iterator[tuple[str, GroupWeight]]:
    """Yield (Hugging Face name, codes, scales and offsets as stored) for every matrix in
    one of GGUF's other block formats (K-quants, Q5_0/Q5_1, Q8_0: app.model.quant.kquants);
    only those in `names` if given."""
    for t in reader.tensors:
        name = hf_name(t.name, arch.architecture)
        kind = t.tensor_type.name
        if name is None or kind in Q4_TYPES or kind not in GROUP_TYPES or len(t.shape) != 2:
            continue
        if names is not None and name not in names:
            continue
        blocks = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # [rows, block bytes]
        yield name, from_gguf(_in_our_row_order(blocks, name, arch), kind)


def open_gguf(path: Path) -> tuple[GGUFReader, ArchConfig]:
    reader = GGUFReader(str(path))
    return reader, read_arch(reader)
