"""FlexDecode (the CUDA decode attention) against the CPU path's gather + SDPA, run here
with eager flex_attention: same block tables, shared prefix blocks, partial last blocks,
a second step with other tables (the first step's entries must be forgotten) and
padding rows."""

import pytest
import torch

from app.model.attention import AttentionMetadata, paged_attention
from app.model.flex_decode import FlexDecode

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BS, NBLK, HKV, H, D = 4, 24, 2, 4, 8


def gathered(q, kc, vc, tables, context):
    """The CPU path: padded tables, a length mask, one SDPA."""
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_decodes=len(tables),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_mask=(torch.arange(width * BS)[None] < torch.tensor(context)[:, None])[
            :, None, None
        ],
    )
    # paged_attention writes the new K/V first; these slots are already in the cache.
    slots = torch.tensor([t[(c - 1) // BS] * BS + (c - 1) % BS for t, c in zip(tables, context)])
    k_new = kc.view(-1, HKV, D)[slots]
    v_new = vc.view(-1, HKV, D)[slots]
    meta.slot_mapping = slots
    return paged_attention(q, k_new, v_new, kc, vc, meta, D**-0.5)


def flex(decoder, q, kc, vc, tables, context, rows=None):
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    decoder.write(padded, torch.tensor(context, dtype=torch.int32))
    return decoder.step(rows or len(tables))(q, kc, vc, D**-0.5)


def test_flex_decode_equals_the_gathered_path():
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(NBLK, BS, HKV, D, generator=g)
    vc = torch.randn(NBLK, BS, HKV, D, generator=g)
    decoder = FlexDecode(NBLK, BS, max_seqs=4, device=torch.device("cpu"), compiled=False)
    steps = [
        ([[3, 5, 9], [3, 5, 11, 12], [7]], [10, 13, 2]),  # rows 0 and 1 share a prefix
        ([[12, 2], [4]], [8, 1]),  # fewer, narrower rows: step 1's entries are gone
    ]
    for tables, context in steps:
        q = torch.randn(len(tables), H, D, generator=g)
        want = gathered(q, kc, vc, tables, context)
        got = flex(decoder, q, kc, vc, tables, context)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_padding_rows_leave_the_real_rows_alone():
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(NBLK, BS, HKV, D, generator=g)
    vc = torch.randn(NBLK, BS, HKV, D, generator=g)
    decoder = FlexDecode(NBLK, BS, max_seqs=4, device=torch.device("cpu"), compiled=False)
    tables, context = [[6, 8], [10]], [7, 3]
    q = torch.randn(4, H, D, generator=g)
    # Two padding rows the way a CUDA graph bucket fills them: the null block, one token.
    got = flex(decoder, q, kc, vc, tables + [[0], [0]], context + [1, 1])
    want = gathered(q[:2], kc, vc, tables, context)
    torch.testing.assert_close(got[:2], want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()
