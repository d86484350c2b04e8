"""Write small transformers Qwen3, Gemma 3 and Phi-3 models as GGUF files the way
llama.cpp's converter does (no Q/K permutation for these; Gemma's norm weights stored as
1 + w, its pre-feedforward norm as ffn_norm; Phi-3's fused attn_qkv and ffn_up), so the
reader's answer is known: the HF model's own."""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from tests.model.gguf_export import _copy_tokenizer

F32 = GGMLQuantizationType.F32


def tiny_hf(family: str, vocab: int, seed: int = 0):
    """A small random Qwen3 or Gemma 3 (6 layers: Gemma's 6th attends globally, the others
    over the last 8 positions)."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )  # fmt: skip
    if family != "phi3":
        common["hidden_size"] = 64
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=False))
    elif family == "phi3":
        del common["head_dim"]  # hidden / heads
        cfg = Phi3Config(**common, hidden_size=128, sliding_window=None, pad_token_id=0)
        model = Phi3ForCausalLM(cfg)
    else:
        cfg = Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=32)
        model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # norms away from their init of exactly 1 (or 0 for Gemma)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def write_family_gguf(
    model, path: Path, tokenizer_source: Path, linear_type: GGMLQuantizationType = F32
) -> Path:
    c = model.config
    family = {"gemma3_text": "gemma3", "gemma3": "gemma3"}.get(c.model_type, c.model_type)
    writer = GGUFWriter(str(path), family)
    writer.add_name(f"tiny-{family}")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    theta = rope["full_attention"]["rope_theta"] if family == "gemma3" else rope["rope_theta"]
    assert rope.get("rope_type", "default") == "default" or family == "gemma3"
    writer.add_rope_freq_base(float(theta))
    if family == "gemma3":
        writer.add_sliding_window(c.sliding_window)
    writer.add_vocab_size(c.vocab_size)
    _copy_tokenizer(writer, tokenizer_source)
    state = model.state_dict()

    def add(name: str, t: torch.Tensor, qtype: GGMLQuantizationType = F32) -> None:
        data = t.detach().float().numpy()
        if family == "gemma3" and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's converter: Gemma scales by 1 + w
        if qtype == F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if not c.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    }
    if family == "gemma3":
        names |= {
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
    else:
        names |= {"post_attention_layernorm": "ffn_norm"}
    if family == "phi3":
        del names["self_attn.q_norm"], names["self_attn.k_norm"]
    linears = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    if family == "phi3":
        linears = {
            "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
            "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        }  # fmt: skip
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, ours in names.items():
            add(f"blk.{i}.{ours}.weight", state[p + hf + ".weight"])
        for hf, ours in linears.items():
            add(f"blk.{i}.{ours}.weight", state[p + hf + ".weight"], linear_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
