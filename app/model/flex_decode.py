"""Decode attention straight from the paged cache, for CUDA: FlexAttention (PyTorch's
`torch.nn.attention.flex_attention`) with a block mask whose KV blocks are the sequence's
own cache blocks, so no padded copy of K/V is gathered (the CPU path in attention.py
gathers; there that is the measured fast way).

The whole cache is one long key sequence of num_blocks * block_size slots
(K: (1, Hkv, slots, D), broadcast over the batch); query row b is one decoding sequence.
Row b's block mask lists its block table (kv_num_blocks[b] = its blocks, kv_indices[b] =
their ids), and the mask function keeps a slot only when it holds one of row b's first
context_lens[b] tokens: `logical[b, block]` is that block's index in row b's table (-1:
not in it). This is the construction of PyTorch's own paged-attention example; the
compiled kernel visits only the listed blocks, the eager one (the CPU tests) relies on the
mask function alone, so both are exact.

Buffers are allocated once at their largest ([max_seqs, num_blocks]) and written in place
each step: CUDA graphs replay them by address (app.engine.cuda_graphs).
Not measured: no GPU was at hand when this was written (docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Q_BLOCK = 128  # one query block holds the single decode query of each row


class FlexDecode:
    """Per-step block masks over the paged cache and the FlexAttention call."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_seqs: int,
        device: torch.device,
        compiled: bool = True,
    ) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.num_blocks, self.block_size = num_blocks, block_size
        i32 = dict(dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(max_seqs, 1, 1, num_blocks, **i32)  # (B, H=1, Qblk, n)
        self.kv_num_blocks = torch.ones(max_seqs, 1, 1, **i32)
        self.logical = torch.full((max_seqs, num_blocks), -1, **i32)  # (B, n): index or -1
        self.context_lens = torch.ones(max_seqs, **i32)
        self.positions = torch.arange(num_blocks, **i32)
        self._used = (0, 0)  # rows and width the last write() set in `logical`
        # Where PyTorch's decoding kernel does not apply (a batch size that recompiled as
        # dynamic, query heads per KV head not a power of two), its general kernel runs,
        # whose KV tile must divide the cache block: its default (64 or more) refuses 16.
        self.kernel_options = {"BLOCK_N": min(block_size, 64)}
        # Eager flex_attention computes the full score matrix: fine for tests, not for use.
        self._flex = torch.compile(flex_attention) if compiled else flex_attention

        logical, lens, bs = self.logical, self.context_lens, block_size

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            j = logical[b, kv_idx // bs]
            return (j >= 0) & (j * bs + kv_idx % bs < lens[b])

        self.mask_mod = mask_mod

    def write(self, tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        """This step's rows: tables (B, W) int32 block ids (padded with the null block 0),
        context_lens (B,) int32, both on the device. Device-side work only, no sync."""
        rows, width = self._used
        if rows:  # forget the last step's tables
            old = self.kv_indices[:rows, 0, 0, :width].long()
            self.logical[:rows].scatter_(1, old, -1)
        B, W = tables.shape
        bs = self.block_size
        self.kv_indices[:B, 0, 0, :W] = tables
        self.kv_num_blocks[:B, 0, 0] = (context_lens + bs - 1) // bs
        self.context_lens[:B] = context_lens
        # Padding entries (block 0, index >= the row's block count) land past the context
        # and are masked; a real table never holds the null block.
        self.logical[:B].scatter_(1, tables.long(), self.positions[:W].expand(B, W))
        self._used = (B, W)

    def step(self, batch: int) -> PagedDecode:
        """The attention of `batch` rows over what write() last set (rows past its B: the
        padding of a CUDA graph bucket, whatever they attend is discarded)."""
        from torch.nn.attention.flex_attention import BlockMask

        mask = BlockMask.from_kv_blocks(
            self.kv_num_blocks[:batch],
            self.kv_indices[:batch],
            BLOCK_SIZE=(Q_BLOCK, self.block_size),
            mask_mod=self.mask_mod,
            seq_lengths=(1, self.num_blocks * self.block_size),
            compute_q_blocks=False,  # forward only
        )
        return PagedDecode(self, mask)


@dataclass
class PagedDecode:
    """One step's decode attention (AttentionMetadata.decode_flex)."""

    flex: FlexDecode
    block_mask: Any

    def __call__(
        self,
        q: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        B, H, D = q.shape
        hkv = k_cache.shape[2]
        k = k_cache.view(1, -1, hkv, D).transpose(1, 2)  # (1, Hkv, slots, D): a view
        v = v_cache.view(1, -1, hkv, D).transpose(1, 2)
        o = self.flex._flex(
            q.unsqueeze(2),
            k,
            v,
            block_mask=self.block_mask,
            scale=scale,
            enable_gqa=True,
            kernel_options=self.flex.kernel_options,
        )  # (B, H, 1, D)
        return o.view(B, H, D)
