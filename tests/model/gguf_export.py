"""Write a transformers Llama model as a GGUF file the way llama.cpp's converter
(convert_hf_to_gguf.py) does, so that tests can feed our GGUF reader files whose right
answer is known: the HF model's own forward.

What the converter does that a reader must undo or apply, and this writer reproduces:
- Q and K projection rows permuted per head from halves (i, i + d/2) to pairs (2i, 2i + 1);
- a Llama 3 `rope_scaling` becomes a `rope_freqs` tensor of per-dimension divisors of the
  rotary frequencies (no scaling metadata);
- weights optionally quantized (gguf.quants, the converter's numpy reference quantizers).

The tokenizer (vocabulary, merges, chat template) is copied from another GGUF file, the
default model's: the tiny test models share its vocabulary.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

F32 = GGMLQuantizationType.F32


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of each head from (half, i) order to (i, half) order."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(config) -> np.ndarray:
    """What the converter stores for rope_type "llama3": for each rotary frequency, the
    number it is divided by (1 for short wavelengths, `factor` for long ones, a smooth
    blend between). Computed in float32, as the converter does."""
    scaling = rope_params(config)
    base = float(scaling["rope_theta"])
    dim = config.head_dim
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def rope_params(config) -> dict:
    """theta and scaling in one dict (transformers 5 keeps them so; 4.x kept them apart)."""
    params = dict(getattr(config, "rope_parameters", None) or config.rope_scaling or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _copy_tokenizer(writer: GGUFWriter, source: Path) -> None:
    reader = GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)


def write_llama_gguf(
    model,
    path: Path,
    tokenizer_source: Path,
    linear_type: GGMLQuantizationType = F32,
    embedding_type: GGMLQuantizationType = F32,
    name: str = "tiny-llama",
    overrides: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """`model`: a transformers LlamaForCausalLM. Linear weights are stored as
    `linear_type`, the embedding (and an untied output) as `embedding_type`, norms in F32;
    `overrides` sets the type of some linears by GGUF name ({"attn_v": Q8_0}), as llama.cpp's
    mixed quantizations do."""
    overrides = overrides or {}
    c = model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = rope_params(c)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_vocab_size(c.vocab_size)
    _copy_tokenizer(writer, tokenizer_source)

    def add(gguf_name: str, t: torch.Tensor, qtype: GGMLQuantizationType = F32) -> None:
        qtype = overrides.get(gguf_name.split(".")[-2], qtype) if qtype != F32 else qtype
        data = t.detach().float().numpy()
        if qtype == F32:
            writer.add_tensor(gguf_name, data)
        else:
            writer.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)

    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(c))
    state = model.state_dict()
    add("token_embd.weight", state["model.embed_tokens.weight"], embedding_type)
    add("output_norm.weight", state["model.norm.weight"])
    if not c.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"], embedding_type)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q = torch.from_numpy(
            llama_cpp_permute(state[p + "self_attn.q_proj.weight"].numpy(), c.num_attention_heads)
        )
        k = torch.from_numpy(
            llama_cpp_permute(state[p + "self_attn.k_proj.weight"].numpy(), c.num_key_value_heads)
        )
        add(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", q, linear_type)
        add(f"blk.{i}.attn_k.weight", k, linear_type)
        add(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"], linear_type)
        add(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"], linear_type)
        add(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"], linear_type)
        add(f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"], linear_type)
        add(f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"], linear_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
