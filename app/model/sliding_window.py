"""Attention over the last `window` positions only (Gemma 3's local layers), over the same
paged KV cache as full attention (app/model/attention.py).

The blocks of a sequence stay as they are and the keys that fell out of the window are
never read: their memory in these layers may have been given back (KVCache.release_local).
Every query row attends to the keys at positions p with q - window < p <= q. Where
Parley's CPU kernels are loaded, decodes and prompt chunks attend in place through
paged_decode / paged_prefill with the window: one call a step for all decodes, and each
row in the bits a decode at its position gets, so a prompt's chunking and the prefix cache
change nothing, as in the global layers. Otherwise PyTorch's SDPA: decodes gathered by
block table, one call a sequence over exactly its window (its bits do not depend on the
sequences beside it), prefill chunks over their own K/V (a fresh prompt) or the gathered
context with a mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.model.attention import AttentionMetadata


def _keep(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """(rows, keys) bool: True where a query at q_pos attends to a key at k_pos."""
    d = q_pos[:, None] - k_pos[None, :]
    return (d >= 0) & (d < window)


def attend_window(
    q: torch.Tensor,  # [T, H, D], rotary applied
    k: torch.Tensor,  # [T, Hkv, D], rotary applied
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], the step's K/V stored
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    positions: torch.Tensor,  # [T] int64: each token's position in its sequence
) -> torch.Tensor:
    """Returns [T, H, D]."""
    H, D = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    out = torch.empty_like(q)
    n = meta.num_decodes
    if n and meta.decode_lens is not None:  # Parley's CPU kernel, over the cache in place
        out[:n] = torch.ops.parley.paged_decode(
            q[:n], k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, scale, window
        )
    elif n:
        if meta.decode_block_tables is None:
            raise NotImplementedError("local attention runs on the CPU path (block tables)")
        # One call a sequence over exactly its window's keys: no padding to the batch's
        # longest, so a decode's bits do not depend on the sequences beside it.
        bs = k_cache.shape[1]
        for i, pos in enumerate(positions[:n].tolist()):
            first = max(0, pos + 1 - window)
            blocks = meta.decode_block_tables[i, first // bs : pos // bs + 1]
            ks = k_cache.index_select(0, blocks).view(-1, hkv, D)[
                first % bs : first % bs + pos + 1 - first
            ]
            vs = v_cache.index_select(0, blocks).view(-1, hkv, D)[
                first % bs : first % bs + pos + 1 - first
            ]
            qs = q[i].view(hkv, H // hkv, D)  # (Hkv, G, D)
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1), vs.transpose(0, 1), scale=scale
            )
            out[i] = o.reshape(H, D)
    for p in meta.prefills:
        s, e = p.start, p.start + p.num_tokens
        if meta.prefill_in_place:
            out[s:e] = torch.ops.parley.paged_prefill(
                q[s:e], k_cache, v_cache, p.block_table, p.context_len - p.num_tokens, scale,
                window,
            )  # fmt: skip
            continue
        q_pos = positions[s:e].cpu()
        if p.block_table is None:  # a fresh prompt: its own K/V are the whole context
            ks, vs, k_pos = k[s:e], v[s:e], q_pos
        else:  # from the block of the first row's first key: those before are never read
            bs = k_cache.shape[1]
            skip = max(0, int(q_pos[0]) - window + 1) // bs
            table = p.block_table[skip:]
            n = p.context_len - skip * bs
            ks = k_cache.index_select(0, table).view(-1, hkv, D)[:n]
            vs = v_cache.index_select(0, table).view(-1, hkv, D)[:n]
            k_pos = torch.arange(skip * bs, p.context_len)
        keep = _keep(q_pos, k_pos, window).to(q.device)
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None],
            ks.transpose(0, 1)[None],
            vs.transpose(0, 1)[None],
            attn_mask=keep,
            scale=scale,
            enable_gqa=True,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out
