"""Attention backends: each attention path builds the metadata its kernels read.

Three paths attend over the paged cache (app.model.attention):

- `SdpaBackend`: decodes gather their blocks and attend through PyTorch's SDPA under a
  length mask; prompt chunks that continue a cached prefix gather it too. Any device.
- `CpuKernelBackend`: Parley's CPU kernels (app/model/kernels) read the blocks in place:
  decodes through paged_decode, and prompt chunks through paged_prefill where the CPU
  allows (`prefill_in_place`). No masks are built.
- `FlexBackend`: on CUDA, decodes attend through FlexAttention over the cache in place
  (flex_decode.py), and CUDA graphs replay them; prompts as SdpaBackend.

The choice is made once, when the model runner is built (the layer ops name theirs:
TorchOps.attention); a step then asks its backend for metadata and never asks the model
what it is. Inputs are plain block tables and lengths: this floor knows no scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from app.model.attention import AttentionMetadata, PrefillChunk, additive_mask, prefix_mask

if TYPE_CHECKING:
    from app.model.flex_decode import FlexDecode


class SdpaBackend:
    """Gathered blocks + PyTorch's SDPA; masks built once a step, shared by all layers."""

    name = "gathered blocks + SDPA"
    prefill_in_place = False

    def __init__(self, block_size: int, query_groups: int, dtype: torch.dtype) -> None:
        self.block_size = block_size
        self.query_groups = query_groups  # query heads per K/V head
        self.dtype = dtype  # the cache's: additive masks are built in it

    def metadata(self, num_decodes: int) -> AttentionMetadata:
        """A step's metadata before its decodes and prompt chunks are added."""
        return AttentionMetadata(
            slot_mapping=torch.empty(0),
            num_decodes=num_decodes,
            prefill_in_place=self.prefill_in_place,
        )

    def add_decodes(
        self, meta: AttentionMetadata, tables: list[list[int]], context: list[int]
    ) -> None:
        """The step's decodes: one block table each (padded to one width) and the number
        of tokens each attends to."""
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64)
        lens = torch.tensor(context, dtype=torch.int64)
        width = len(tables[0]) * self.block_size
        keep = torch.arange(width)[None, :] < lens[:, None]  # (B, L)
        meta.decode_mask = additive_mask(keep, self.dtype)[:, None, None, :]

    def add_prefill(self, meta: AttentionMetadata, chunk: PrefillChunk, table: list[int]) -> None:
        """A prompt chunk of `chunk.num_tokens` after `cached` tokens: a chunk that
        continues a cached prefix attends through its block table, under a mask."""
        cached = chunk.context_len - chunk.num_tokens
        if cached > 0:
            chunk.block_table = self._table(table, chunk.context_len)
            chunk.mask = prefix_mask(cached, chunk.num_tokens, self.query_groups, self.dtype)
        meta.prefills.append(chunk)

    def _table(self, table: list[int], context_len: int) -> torch.Tensor:
        return torch.tensor(table[: -(-context_len // self.block_size)], dtype=torch.int64)


class CpuKernelBackend(SdpaBackend):
    """Parley's CPU kernels: decodes (and, where `prefill_in_place`, prompt chunks) read
    the cache in place through their block tables; no masks."""

    name = "Parley's CPU kernel over the cache"

    def __init__(
        self, block_size: int, query_groups: int, dtype: torch.dtype, prefill_in_place: bool
    ) -> None:
        super().__init__(block_size, query_groups, dtype)
        self.prefill_in_place = prefill_in_place

    def add_decodes(
        self, meta: AttentionMetadata, tables: list[list[int]], context: list[int]
    ) -> None:
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64)
        meta.decode_lens = torch.tensor(context, dtype=torch.int64)

    def add_prefill(self, meta: AttentionMetadata, chunk: PrefillChunk, table: list[int]) -> None:
        if not self.prefill_in_place:
            return super().add_prefill(meta, chunk, table)
        chunk.block_table = self._table(table, chunk.context_len)
        meta.prefills.append(chunk)


class FlexBackend(SdpaBackend):
    """FlexAttention decodes over the cache in place, up to `max_rows` a step (more fall
    back to the gather); its per-size variants are what CUDA graphs capture."""

    name = "FlexAttention over the cache"

    def __init__(
        self, block_size: int, query_groups: int, dtype: torch.dtype, flex: FlexDecode,
        max_rows: int,
    ) -> None:  # fmt: skip
        super().__init__(block_size, query_groups, dtype)
        self.flex = flex
        self.max_rows = max_rows

    def add_decodes(
        self, meta: AttentionMetadata, tables: list[list[int]], context: list[int]
    ) -> None:
        if len(tables) > self.max_rows:
            return super().add_decodes(meta, tables, context)
        device = self.flex.context_lens.device
        self.flex.write(_upload(tables, torch.int32, device), _upload(context, torch.int32, device))
        meta.decode_flex = self.flex.step(len(tables))

    def graph_metadata(self, slot_mapping: torch.Tensor, size: int) -> AttentionMetadata:
        """What a CUDA graph of `size` decodes captures: the tables and lengths are read
        from the FlexDecode's buffers, which each replay fills (flex.write)."""
        return AttentionMetadata(
            slot_mapping=slot_mapping, num_decodes=size, decode_flex=self.flex.step(size)
        )


AttentionBackend = SdpaBackend | CpuKernelBackend | FlexBackend


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Index values to the device through pinned memory, asynchronously (no host sync)."""
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
