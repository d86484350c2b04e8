"""SchedulerOutput -> one flat batch -> forward -> sampled tokens.

The flat batch puts decodes first (one token each, attended in one batched call) and then
each prefill chunk as a contiguous run (see app.model.attention). Only requests that reach
their last known token this step get logits, and the prompt tokens of requests that asked
for their logprobs (echo, scoring). Choices forked from a request sample from its row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.engine.kv_cache import KVCache
from app.engine.logprobs import Logprob, token_logprobs
from app.engine.request import Request
from app.engine.sampler import Sampler
from app.engine.scheduler import SchedulerOutput
from app.engine.structured import token_masks
from app.model.attention import AttentionMetadata, PrefillChunk
from app.model.llama import LlamaModel


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one forward pass produced: the next token of each request that sampled, and
    the logprobs of those that asked."""

    sampled: dict[str, int]  # request id -> token id
    logprobs: dict[str, Logprob] = field(default_factory=dict)  # of the sampled token
    # request id -> logprobs of the prompt tokens this step's logits scored, in order
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptRows:
    """Logits rows [row, row + count) score prompt tokens first_token .. + count."""

    request: Request
    row: int
    count: int
    first_token: int


@dataclass
class ModelInput:
    """The tensors of one forward pass."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (S,)
    sampling_requests: list[Request]  # S requests, in the order of logits_indices
    # With prompt rows among the logits: which row each sampling request samples from.
    sample_rows: list[int] | None = None
    prompt_rows: list[PromptRows] = field(default_factory=list)


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
        if out.block_copies:
            self.kv_cache.copy_blocks(out.block_copies)
        inp = self.prepare(out)
        logits = self.model(
            inp.input_ids, inp.positions, self.kv_cache.layers, inp.meta, inp.logits_indices
        ).float()
        result = ModelRunnerOutput({})
        for p in inp.prompt_rows:
            given = p.request.all_token_ids[p.first_token : p.first_token + p.count]
            rows = logits[p.row : p.row + p.count]
            k = p.request.params.prompt_logprobs or 0
            scored = token_logprobs(rows, torch.tensor(given), [k] * p.count)
            result.prompt_logprobs[p.request.request_id] = scored
        requests = inp.sampling_requests
        if not requests:
            return result
        if inp.sample_rows is not None:
            logits = logits[inp.sample_rows]
        # Logprobs come from the logits before the sampler changes them in place.
        asking = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        raw = logits[asking] if asking else None
        masks = token_masks([r.grammar for r in requests], logits.shape[1])
        tokens = self.sampler(logits, requests, masks)
        result.sampled.update(zip((r.request_id for r in requests), tokens.tolist(), strict=True))
        if raw is not None:
            ks = [requests[i].params.logprobs or 0 for i in asking]
            for i, lp in zip(asking, token_logprobs(raw, tokens[asking], ks), strict=True):
                result.logprobs[requests[i].request_id] = lp
        return result

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampling: list[Request] = []
        sample_rows: list[int] = []
        prompt_rows: list[PromptRows] = []

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
            sample_rows.extend(range(len(decodes)))

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
            req = s.request
            if req.params.prompt_logprobs is not None:
                # Position p's logits score token p + 1; score each prompt token once,
                # even when a preempted request computes its prompt again.
                lo = max(start, len(req.prompt_logprobs) - 1)
                hi = min(start + n, req.num_prompt_tokens - 1)
                if hi > lo:
                    prompt_rows.append(PromptRows(req, len(logits_indices), hi - lo, lo + 1))
                    logits_indices.extend(range(first + lo - start, first + hi - start))
            if s.samples and req.max_tokens > 0:
                # Choices forked at this step sample from the same row (the LM head runs
                # once more for each: n rows, once per prompt).
                for r in (req, *s.forks):
                    sample_rows.append(len(logits_indices))
                    logits_indices.append(first + n - 1)
                    sampling.append(r)

        meta.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        if self.device.type != "cpu":
            _move(meta, self.device)
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            sampling_requests=sampling,
            sample_rows=sample_rows if prompt_rows else None,
            prompt_rows=prompt_rows,
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
