"""Decode steps replayed as CUDA graphs, one graph per bucketed batch size (CUDA only).

A decode step of a small model launches hundreds of small kernels from Python; a CUDA
graph records them once and replays them with one launch. A graph replays fixed shapes
at fixed addresses, so every input lives in a static buffer sized for the largest bucket,
a batch of n is padded up to the smallest bucket >= n, and the graph for a bucket is
captured the first time a batch of that size arrives. Padding rows decode token 0 at
position 0 into slot 0 (the null block, which no request owns) and attend only that slot;
their logits are dropped. Attention inside a graph must not depend on the step's context
widths: it goes through FlexDecode, whose buffers are full-size and written in place.
Sampling stays outside the graph (it depends on each request's parameters).

Not measured: no GPU was at hand when this was written (docs/gpu.md). The pure
parts (bucket choice, padding) are tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.model.attention_backends import FlexBackend
from app.model.llama import LlamaModel


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16, up to and
    including max_num_seqs. At most 1/16th of a large batch is padding."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sorted({*sizes, max_num_seqs})


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds n rows; None when none does."""
    return next((b for b in buckets if b >= n), None)


@dataclass(frozen=True)
class DecodeBatch:
    """A decode-only step's rows on the host, padded to a bucket (pad_decode_batch)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]  # rows x width block ids, padded with the null block 0
    context_lens: list[int]


def pad_decode_batch(batch: DecodeBatch, rows: int) -> DecodeBatch:
    """`batch` with padding rows up to `rows`: token 0 at position 0 written to slot 0 of
    the null block, a table of null blocks and a context of one token (that slot)."""
    extra = rows - len(batch.input_ids)
    if extra < 0:
        raise ValueError(f"{len(batch.input_ids)} rows do not fit a bucket of {rows}")
    width = len(batch.tables[0]) if batch.tables else 1
    return DecodeBatch(
        batch.input_ids + [0] * extra,
        batch.positions + [0] * extra,
        batch.slots + [0] * extra,
        batch.tables + [[0] * width for _ in range(extra)],
        batch.context_lens + [1] * extra,
    )


class DecodeGraphs:
    """Captures and replays the model's decode forward per bucket. `run` returns the
    logits (n, vocab) of a decode-only step of n rows, or None when n has no bucket."""

    def __init__(
        self,
        model: LlamaModel,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        attention: FlexBackend,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_layers = model, kv_layers
        self.attention, self.flex = attention, attention.flex
        self.buckets = decode_buckets(max_num_seqs)
        top = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(top, **i64)
        self.positions = torch.zeros(top, **i64)
        self.slots = torch.zeros(top, **i64)
        self.rows = torch.arange(top, **i64)  # logits_indices: every row samples
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, batch: DecodeBatch) -> torch.Tensor | None:
        n = len(batch.input_ids)
        size = bucket_for(n, self.buckets)
        if size is None:
            return None
        if size not in self.graphs:
            self._capture(size)
        self._load(pad_decode_batch(batch, size))
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]

    def _load(self, b: DecodeBatch) -> None:
        """Host rows -> the static buffers (pinned, asynchronous copies)."""
        size = len(b.input_ids)
        for dst, values in ((self.input_ids, b.input_ids), (self.positions, b.positions)):
            dst[:size].copy_(torch.tensor(values, pin_memory=True), non_blocking=True)
        self.slots[:size].copy_(torch.tensor(b.slots, pin_memory=True), non_blocking=True)
        dev = self.input_ids.device
        tables = torch.tensor(b.tables, dtype=torch.int32, pin_memory=True)
        lens = torch.tensor(b.context_lens, dtype=torch.int32, pin_memory=True)
        self.flex.write(tables.to(dev, non_blocking=True), lens.to(dev, non_blocking=True))

    def _capture(self, size: int) -> None:
        # Capture over padding rows (they touch only the null block's slot 0); run() loads
        # the real rows afterwards.
        self._load(pad_decode_batch(DecodeBatch([], [], [], [], []), size))
        meta = self.attention.graph_metadata(self.slots[:size], size)
        args = (self.input_ids[:size], self.positions[:size], self.kv_layers, meta)
        side = torch.cuda.Stream()  # warm-up off the default stream, as PyTorch advises
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles FlexAttention for this shape, sets up cuBLAS
                self.model(*args, self.rows[:size])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(*args, self.rows[:size])
        self.graphs[size] = (graph, logits)
