"""Paged attention against the plain computation: a prompt chunk that continues a cached
prefix gives, to the bit, what the whole prompt computed without the cache gives for the
same rows (its causal square padded with the cached rows, or its masked rectangle with the
query heads of each K/V head folded into one run of rows).

Not to the bit for every shape: a chunk of one row (the last token of a prompt whose rest
was cached) rounds differently in fp32, folded or not; the kernel takes another path for
so few query rows. Folding made fewer shapes differ than before (4 of 22 against 7 of 22
probed, all of them chunks of one to three rows).
"""

import pytest
import torch

from app.model.attention import (
    FOLD_MAX_ELEMENTS,
    AttentionMetadata,
    PrefillChunk,
    paged_attention,
    prefix_mask,
)

BLOCK, HKV, H, D = 16, 3, 9, 64


def whole_and_chunk(cached: int, new: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(cached * 1000 + new)
    total = cached + new
    q = torch.randn(total, H, D, generator=g).to(dtype)
    k = torch.randn(total, HKV, D, generator=g).to(dtype)
    v = torch.randn(total, HKV, D, generator=g).to(dtype)
    blocks = -(-total // BLOCK)
    table = torch.randperm(blocks + 4, generator=g)[:blocks]  # blocks anywhere in the pool
    slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:total]

    def cache():
        return torch.zeros(blocks + 4, BLOCK, HKV, D, dtype=dtype)

    # The whole prompt, nothing cached: its own K/V, one causal pass.
    kc, vc = cache(), cache()
    meta = AttentionMetadata(slots, prefills=[PrefillChunk(0, total, total, None, None)])
    whole = paged_attention(q, k, v, kc, vc, meta, D**-0.5)[cached:]
    # The prefix already in the cache, the rest as a chunk through the block table.
    kc, vc = cache(), cache()
    kc.view(-1, HKV, D)[slots[:cached]] = k[:cached]
    vc.view(-1, HKV, D)[slots[:cached]] = v[:cached]
    chunk = PrefillChunk(0, new, total, table, prefix_mask(cached, new, H // HKV, dtype))
    meta = AttentionMetadata(slots[cached:], prefills=[chunk])
    part = paged_attention(q[cached:], k[cached:], v[cached:], kc, vc, meta, D**-0.5)
    return whole, part, chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "cached, new, square",
    [
        (16, 700, True),
        (5, 300, True),
        (48, 49, True),
        (32, 3, True),  # a prompt of at most PAD_MAX_CONTEXT tokens: the square, always
        (63, 1, True),
        (300, 40, False),
        (64, 64, False),
        (1488, 19, False),
        (700, 3, False),
        (2000, 300, False),
        (3000, 600, False),  # past FOLD_MAX_ELEMENTS: a bool mask, heads unfolded
    ],
)
def test_a_chunk_after_a_cached_prefix_equals_the_whole_prompt(cached, new, square, dtype):
    whole, part, chunk = whole_and_chunk(cached, new, dtype)
    assert (chunk.mask is None) == square
    folded = H // HKV * new * (cached + new) <= FOLD_MAX_ELEMENTS
    assert square or (chunk.mask.dtype != torch.bool) == folded
    assert torch.equal(part, whole)
