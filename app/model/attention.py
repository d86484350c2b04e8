"""Attention over the paged KV cache.

A step's tokens form one flat batch: first the decoding sequences (one token each), then
the prefill chunks, each a contiguous run of tokens of one sequence. Every layer:

1. writes the new K/V rows into their slots (`slot = block_id * block_size + offset`);
2. decodes attend in one batched call: their blocks are gathered by block table into a
   padded [B, L] view and masked by context length. The G query heads that share a K/V
   head become G "query rows" of that head (q: [B, Hkv, G, D]), so grouped-query
   attention needs no repeat of K/V;
3. each prefill chunk attends on its own: a fresh prompt (nothing cached before it) uses
   its new K/V directly with a causal mask; a chunk that continues a cached prefix gathers
   its context from the cache. Then, when the chunk is longer than the prefix (a long
   first message after a cached system prompt), the chunk's queries are padded in front
   with zeros for the cached rows and the whole context attends as one causal square,
   whose upper half the flash kernel skips: the same call, shapes and rounding as the
   whole prompt computed without the cache (and so does any prompt of at most
   PAD_MAX_CONTEXT tokens). Otherwise (a follow-up after a long history)
   the chunk's rows attend through a bottom-right-aligned causal mask, with the G query
   heads of each K/V head folded into one run of G x n rows as decodes do: fewer, larger
   work items (a long chunk, whose folded mask would be large, keeps its heads as they
   are). Either way the rows round as in the whole prompt's pass, except for chunks of a
   row or few, for which the flash kernel takes another path
   (tests/model/test_attention.py).

Where Parley's CPU kernels are loaded (the default for int4 weights on the CPU), steps 2
and 3 run in C++ over the cache in place instead: decodes through paged_decode, each
prefill chunk through paged_prefill (AttentionMetadata.decode_lens, .prefill_in_place).
The two compute a position's row in the same operations in the same order, so its bits
depend on nothing but its query and the keys before it: not on the batch, the chunking,
the prefix cache, nor on whether the token was decoded or came in a prompt. Through
PyTorch's SDPA above, a chunk of a few rows rounds apart from the whole prompt's pass,
and a decode apart from both.

The masks and index tensors are built once per step (AttentionMetadata, by the step's
attention backend: attention_backends.py) and shared by all layers, so the Python work
per layer does not grow with the number of decoding sequences; the gather is an
index_select over whole blocks. On CUDA, decodes attend through FlexAttention over the
cache in place instead (flex_decode.py, AttentionMetadata.decode_flex); the CPU never
takes that branch. What these choices measured: bench/README.md, "Attention paths".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from app.model.flex_decode import PagedDecode


@dataclass
class PrefillChunk:
    """One sequence's run of new tokens in the flat batch."""

    start: int  # first token's index in the flat batch
    num_tokens: int
    context_len: int  # tokens attended to by the last query: cached + new
    block_table: torch.Tensor | None  # [num_blocks] int64; None when nothing was cached
    # prefix_mask: [groups * num_tokens, context_len] additive (folded heads), or
    # [num_tokens, context_len] bool for a long chunk; None for a causal square
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Where a step's K/V goes and what each query attends to."""

    slot_mapping: torch.Tensor  # [T] int64
    num_decodes: int = 0  # the first num_decodes tokens are decodes, one per sequence
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    # [num_decodes, 1, 1, max_blocks * block_size]: 0 where a decode attends, -inf past its
    # context (a bool mask, True = attend, works too)
    decode_mask: torch.Tensor | None = None
    # [num_decodes] int64, instead of the mask where Parley's CPU kernels are loaded: decodes
    # attend over the cache in place (kernels/cpu_kernels.cpp, paged_decode)
    decode_lens: torch.Tensor | None = None
    # On CUDA: decodes attend through FlexAttention over the cache in place (flex_decode.py)
    # instead of the gathered tables and mask above. Always None on the CPU.
    decode_flex: PagedDecode | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Where Parley's CPU kernels are loaded: every prefill chunk attends over the cache in
    # place through its block table (kernels/cpu_kernels.cpp, paged_prefill), each row in
    # the bits a decode at its position gets, whatever the chunking; no masks are built.
    prefill_in_place: bool = False


# A folded mask is built once a step in the cache's dtype: up to this many elements (8 MB
# in bf16). A long chunk after a long prefix keeps an unfolded bool mask instead, 1 byte
# per query row and key, as large chunks gain nothing from folding.
FOLD_MAX_ELEMENTS = 4 << 20

# A prompt of at most this many tokens always attends as the whole prompt's causal square,
# however much of it was cached: a short prompt asked twice, the second time after its
# cached blocks, then gives the same bits as the first. It costs ~0.1 ms a layer more than
# the masked rows at 64 tokens (bench/README.md, "Parley's CPU kernels").
PAD_MAX_CONTEXT = 64


def prefix_mask(
    cached: int, new: int, groups: int = 1, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """The mask of `new` query rows after `cached` tokens, bottom-right-aligned causal.
    For a short chunk, additive (0 = attend, -inf = not) with its rows repeated for each
    of the `groups` query heads that share a K/V head: [groups * new, cached + new], for
    the folded call. For a long one, bool (True = attend): [new, cached + new]. None when
    the rows are cheaper as the whole context's causal square, cached rows padded in:
    (cached + new)^2 / 2 scores against new * (cached + new), or when the prompt is short
    enough that the bits matter more (PAD_MAX_CONTEXT)."""
    if cached < new or cached + new <= PAD_MAX_CONTEXT:
        return None
    q_pos = torch.arange(cached, cached + new)[:, None]
    keep = torch.arange(cached + new)[None, :] <= q_pos  # (new, cached + new)
    if groups * keep.numel() > FOLD_MAX_ELEMENTS:
        return keep
    return additive_mask(keep, dtype).repeat(groups, 1)


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as SDPA would turn it into in every call: 0 where
    True, -inf where False. Built once a step, the same values give the same result."""
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D], rotary applied
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write the step's K/V rows into their cache slots."""
    num_kv_heads, D = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, D).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, D).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D], rotary applied
    k: torch.Tensor,  # [T, Hkv, D], rotary applied
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store k/v in the cache, then attend. Returns [T, H, D]."""
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return attend(q, k, v, k_cache, v_cache, meta, scale)


def attend(
    q: torch.Tensor,  # [T, H, D], rotary applied
    k: torch.Tensor,  # [T, Hkv, D], rotary applied
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], the step's K/V stored
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attend, the step's K/V already in the cache. Returns [T, H, D]."""
    T, _, D = q.shape
    num_kv_heads = k.shape[1]
    n = meta.num_decodes
    if n == T and not meta.prefills:  # decode-only step: no copy into a separate output
        return _decode(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if n:
        out[:n] = _decode(q[:n], k_cache, v_cache, meta, scale)
    for p in meta.prefills:
        s, e = p.start, p.start + p.num_tokens
        if meta.prefill_in_place:
            out[s:e] = torch.ops.parley.paged_prefill(
                q[s:e], k_cache, v_cache, p.block_table, p.context_len - p.num_tokens, scale
            )
            continue
        # 4-D (1, heads, n, D) operands: PyTorch's CPU flash kernel takes these (3-D ones
        # with enable_gqa fall back to the math path, ~5x slower at 1,500 tokens).
        qs = q[s:e].transpose(0, 1)[None]  # (1, H, n, D)
        if p.block_table is None:  # a fresh prompt: its own K/V are the whole context
            ks, vs = k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
        else:  # continues a cached prefix: gather the context, mask bottom-right causal
            ks = k_cache.index_select(0, p.block_table).view(-1, num_kv_heads, D)
            vs = v_cache.index_select(0, p.block_table).view(-1, num_kv_heads, D)
            ks = ks[: p.context_len].transpose(0, 1)[None]
            vs = vs[: p.context_len].transpose(0, 1)[None]
            if p.mask is None:  # the whole context's causal square; the cached rows dropped
                cached = p.context_len - p.num_tokens
                qs = F.pad(qs, (0, 0, cached, 0))
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
                )[:, :, cached:]
            elif p.mask.dtype == torch.bool:  # a long chunk: the query heads as they are
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=p.mask, scale=scale, enable_gqa=True
                )
            else:  # query head h = kv * G + g: (1, H, n, D) -> (1, Hkv, G * n, D)
                folded = qs.reshape(1, num_kv_heads, -1, D)
                o = F.scaled_dot_product_attention(folded, ks, vs, attn_mask=p.mask, scale=scale)
                o = o.reshape(qs.shape)  # CUDA's SDPA output is not always viewable
        out[s:e] = o[0].transpose(0, 1)
    return out


def _decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    if meta.decode_flex is not None:
        return meta.decode_flex(q, k_cache, v_cache, scale)
    assert meta.decode_block_tables is not None
    if meta.decode_lens is not None:  # Parley's CPU kernel, over the cache in place
        return torch.ops.parley.paged_decode(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, scale
        )
    B, H, D = q.shape
    num_kv_heads = k_cache.shape[2]
    tables = meta.decode_block_tables
    L = tables.shape[1] * k_cache.shape[1]
    # index_select over whole blocks: ~9x faster than advanced indexing (k_cache[tables]).
    flat = tables.view(-1)
    ks = k_cache.index_select(0, flat).view(B, L, num_kv_heads, D).transpose(1, 2)
    vs = v_cache.index_select(0, flat).view(B, L, num_kv_heads, D).transpose(1, 2)
    qs = q.view(B, num_kv_heads, H // num_kv_heads, D)  # (B, Hkv, G, D)
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(B, H, D)
