"""SchedulerOutput -> one flat batch -> forward -> sampled tokens.

The flat batch puts decodes first (one token each, attended in one batched call) and then
each prefill chunk as a contiguous run (see app.model.attention). Only requests that reach
their last known token this step get logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.kv_cache import KVCache
from app.engine.request import Request
from app.engine.sampler import Sampler
from app.engine.scheduler import SchedulerOutput
from app.model.attention import AttentionMetadata, PrefillChunk
from app.model.llama import LlamaModel


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one forward pass produced: the next token of each request that sampled."""

    sampled: dict[str, int]  # request id -> token id


@dataclass
class ModelInput:
    """The tensors of one forward pass."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (S,)
    sampling_requests: list[Request]  # S requests, in the order of logits_indices


class ModelRunner:
    """Runs the model on a scheduler's decision and samples next tokens."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, sampler: Sampler) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.block_size = kv_cache.block_size
        self.device = kv_cache.tensor.device

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the step's tokens; sample for the requests that reach their end."""
        inp = self.prepare(out)
        logits = self.model(
            inp.input_ids, inp.positions, self.kv_cache.layers, inp.meta, inp.logits_indices
        )
        if not inp.sampling_requests:
            return ModelRunnerOutput({})
        tokens = self.sampler(logits.float(), inp.sampling_requests).tolist()
        ids = (r.request_id for r in inp.sampling_requests)
        return ModelRunnerOutput(dict(zip(ids, tokens, strict=True)))

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampling: list[Request] = []

        decodes = [s for s in out.scheduled if s.is_decode]
        prefills = [s for s in out.scheduled if not s.is_decode]
        for s in decodes:
            pos = s.start
            ids.append(s.request.all_token_ids[pos])
            positions.append(pos)
            slots.append(s.block_ids[pos // bs] * bs + pos % bs)
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decodes=len(decodes))
        if decodes:
            context = [s.start + 1 for s in decodes]
            width = -(-max(context) // bs)
            tables = [
                s.block_ids[:width] + [0] * (width - len(s.block_ids[:width])) for s in decodes
            ]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64)
            lens = torch.tensor(context)
            keep = torch.arange(width * bs)[None, :] < lens[:, None]  # (B, L)
            meta.decode_mask = keep[:, None, None, :]
            logits_indices.extend(range(len(decodes)))
            sampling.extend(s.request for s in decodes)

        for s in prefills:
            start, n = s.start, s.num_tokens
            pos = range(start, start + n)
            first = len(ids)
            ids.extend(s.request.all_token_ids[start : start + n])
            positions.extend(pos)
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            context = start + n
            chunk = PrefillChunk(first, n, context, None, None)
            if start > 0:  # continues a cached prefix: attend through the block table
                chunk.block_table = torch.tensor(table[: -(-context // bs)], dtype=torch.int64)
                q_pos = torch.arange(start, context)[:, None]
                chunk.mask = torch.arange(context)[None, :] <= q_pos  # (n, context)
            meta.prefills.append(chunk)
            if s.samples:
                logits_indices.append(first + n - 1)
                sampling.append(s.request)

        meta.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        if self.device.type != "cpu":
            _move(meta, self.device)
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            sampling_requests=sampling,
        )


def _move(meta: AttentionMetadata, device: torch.device) -> None:
    """Index tensors are built on the CPU; an accelerator needs them on its side."""
    meta.slot_mapping = meta.slot_mapping.to(device, non_blocking=True)
    if meta.decode_block_tables is not None and meta.decode_mask is not None:
        meta.decode_block_tables = meta.decode_block_tables.to(device, non_blocking=True)
        meta.decode_mask = meta.decode_mask.to(device, non_blocking=True)
    for p in meta.prefills:
        if p.block_table is not None and p.mask is not None:
            p.block_table = p.block_table.to(device, non_blocking=True)
            p.mask = p.mask.to(device, non_blocking=True)
