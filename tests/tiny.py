"""A tiny random Llama built in the test: same code paths as the real model, fast."""

from __future__ import annotations

import torch

from app.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TierConfig
from app.engine.engine import LLMEngine
from app.model.arch import ArchConfig
from app.model.loader import LoadedModel


def tiny_arch(vocab_size: int, **overrides) -> ArchConfig:
    fields = dict(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    fields.update(overrides)
    return ArchConfig(**fields)


def tiny_weights(arch: ArchConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights scaled so that logits are well spread (no near-ties for greedy)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    h, kv = arch.hidden_size, arch.kv_size
    weights = {
        "embed_tokens.weight": torch.randn(arch.vocab_size, h, generator=g),
        "norm.weight": torch.ones(h),
    }
    if not arch.tie_word_embeddings:
        weights["lm_head.weight"] = w(arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        weights[p + "input_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        weights[p + "post_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        weights[p + "qkv.weight"] = w(arch.q_size + 2 * kv, h)
        if arch.attention_bias:
            weights[p + "qkv.bias"] = 0.1 * torch.randn(arch.q_size + 2 * kv, generator=g)
        weights[p + "o_proj.weight"] = w(h, arch.q_size)
        weights[p + "gate_up.weight"] = w(2 * arch.intermediate_size, h)
        weights[p + "down.weight"] = w(h, arch.intermediate_size)
    return weights


def tiny_loaded(tokenizer, seed: int = 0, **arch_overrides) -> LoadedModel:
    arch = tiny_arch(len(tokenizer), **arch_overrides)
    eos = frozenset({tokenizer.eos_token_id})
    return LoadedModel("tiny", arch, tiny_weights(arch, seed), tokenizer, eos)


# The weight format and activation dtype of every tiny engine; test modules that rerun a
# suite with quantized weights set them (tests/engine/test_int8_engine.py, test_int4_engine.py).
QUANTIZATION = "none"
DTYPE = "float32"
# The device of every tiny engine; tests/gpu reruns the suites with "cuda".
DEVICE = "cpu"


def tiny_engine(tokenizer, **kw) -> LLMEngine:
    """An engine on a tiny model with a KV cache of exactly `num_blocks` blocks
    (the null block included) and integrity checks after every step. Keywords: those of
    tiny_parts."""
    return LLMEngine(*tiny_parts(tokenizer, **kw))


def tiny_parts(
    tokenizer,
    *,
    num_blocks: int = 256,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    prefill_chunk_while_decoding: int = 64,
    prefix_caching: bool = True,
    seed: int = 0,
    dtype: str | None = None,  # None: DTYPE
    request_timeout_s: float | None = None,
    max_waiting: int = 256,
    batching: str = "static",  # fixed chunks: schedules the tests can predict
    tier: TierConfig | None = None,
    **arch_overrides,
) -> tuple[EngineConfig, LoadedModel]:
    """The config and weights of a tiny engine (for engines built elsewhere, e.g. in a
    Ray actor). With a `tier` (a KV tier below the pool) call engine.close() when done."""
    loaded = tiny_loaded(tokenizer, seed, **arch_overrides)
    arch = loaded.arch
    dtype = dtype or DTYPE
    per_block = 2 * arch.num_layers * block_size * arch.kv_size * getattr(torch, dtype).itemsize
    config = EngineConfig(
        model=ModelConfig(quantization=QUANTIZATION, dtype=dtype),
        cache=CacheConfig(
            kv_cache_bytes=num_blocks * per_block,
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk_while_decoding=prefill_chunk_while_decoding,
            request_timeout_s=request_timeout_s,
            max_waiting=max_waiting,
            batching=batching,
        ),
        device=DEVICE,
        debug_checks=True,
        tier=tier or TierConfig(),
    )
    return config, loaded


def tiny_hf_llama3(vocab: int, seed: int = 0):
    """A random transformers LlamaForCausalLM shaped like Llama 3: its rope_scaling changes
    every rotary frequency band (with head_dim 16 and an original context of 64 tokens:
    some kept, some divided by 8, some blended)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        initializer_range=0.3,
    )
    return transformers.LlamaForCausalLM(config).eval()
