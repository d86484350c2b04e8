"""SchedulerOutput -> one flat batch -> forward -> sampled tokens.

The flat batch puts decodes first (one token each, attended in one batched call) and then
each prefill chunk as a contiguous run (see app.model.attention). Only requests that reach
their last known token this step get logits, and the prompt tokens of requests that asked
for their logprobs (echo, scoring). Choices forked from a request sample from its row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from app.engine.cuda_graphs import DecodeBatch, DecodeGraphs
from app.engine.kv_cache import KVCache
from app.engine.logprobs import Logprob, token_logprobs
from app.engine.request import Request
from app.engine.sampler import Sampler
from app.engine.scheduler import SchedulerOutput
from app.engine.structured import token_masks
from app.model.attention import AttentionMetadata, PrefillChunk
from app.model.attention_backends import AttentionBackend, FlexBackend, SdpaBackend
from app.model.flex_decode import FlexDecode
from app.model.llama import LlamaModel

log = logging.getLogger(__name__)


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
    """Runs the model on a scheduler's decision and samples next tokens.

    The device is the KV cache's, read once here. The attention backend
    (app.model.attention_backends) builds each step's attention metadata: the one the
    model's layer ops name (`attention`, chosen once when the model was built), or on CUDA
    FlexAttention over the cache in place (when it compiles here), whose decode-only steps
    replay CUDA graphs (`cuda_graphs`). On CUDA the step's index tensors go through pinned
    host memory. Either way the one host sync of a step is reading the sampled tokens back
    (and logprobs, for requests that ask).
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        sampler: Sampler,
        *,
        max_num_seqs: int = 64,
        cuda_graphs: bool = False,
        attention: AttentionBackend | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.block_size = kv_cache.block_size
        self.device = kv_cache.tensor.device
        self.pin = self.device.type == "cuda"  # host -> device copies from pinned memory
        self.graphs: DecodeGraphs | None = None
        groups = kv_cache.arch.num_heads // kv_cache.arch.num_kv_heads
        dtype = kv_cache.tensor.dtype
        self.attention = attention or SdpaBackend(self.block_size, groups, dtype)
        if self.device.type == "cuda":
            flex = _flex_decode(kv_cache, max_num_seqs, self.device)
            if flex is not None:
                self.attention = FlexBackend(self.block_size, groups, dtype, flex, max_num_seqs)
        if isinstance(self.attention, FlexBackend) and cuda_graphs:
            self.graphs = DecodeGraphs(
                model, kv_cache.layers, self.attention, max_num_seqs, self.device
            )
        log.info(
            "model runner on %s: decode attention %s, CUDA graphs %s",
            self.device,
            self.attention.name,
            f"for batch sizes {self.graphs.buckets}" if self.graphs else "off",
        )

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the step's tokens; sample for the requests that reach their end."""
        if out.block_copies:
            self.kv_cache.copy_blocks(out.block_copies)
        logits = None
        if self.graphs is not None and all(s.is_decode for s in out.scheduled):
            rows = self._decode_rows(out.scheduled)
            if rows is not None:
                logits = self.graphs.run(rows)  # None: more rows than the largest bucket
        if logits is not None:
            requests = [s.request for s in out.scheduled]  # every decode samples, in order
            inp = ModelInput(_EMPTY, _EMPTY, AttentionMetadata(_EMPTY), _EMPTY, requests)
        else:
            inp = self.prepare(out)
            logits = self.model(
                inp.input_ids, inp.positions, self.kv_cache.layers, inp.meta, inp.logits_indices
            )
        logits = logits.float()
        result = ModelRunnerOutput({})
        for p in inp.prompt_rows:
            given = p.request.all_token_ids[p.first_token : p.first_token + p.count]
            rows = logits[p.row : p.row + p.count]
            k = p.request.params.prompt_logprobs or 0
            given_ids = torch.tensor(given, device=logits.device)
            result.prompt_logprobs[p.request.request_id] = token_logprobs(
                rows, given_ids, [k] * p.count
            )
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
        meta = self.attention.metadata(len(decodes))
        if decodes:
            context = [s.start + 1 for s in decodes]
            width = -(-max(context) // bs)
            tables = [
                s.block_ids[:width] + [0] * (width - len(s.block_ids[:width])) for s in decodes
            ]
            self.attention.add_decodes(meta, tables, context)
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
            chunk = PrefillChunk(first, n, start + n, None, None)
            self.attention.add_prefill(meta, chunk, table)
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

        meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, pin_memory=self.pin)
        if self.device.type != "cpu":
            _move(meta, self.device, self.pin)
        return ModelInput(
            input_ids=self._upload(ids, torch.int64),
            positions=self._upload(positions, torch.int64),
            meta=meta,
            logits_indices=self._upload(logits_indices, torch.int64),
            sampling_requests=sampling,
            sample_rows=sample_rows if prompt_rows else None,
            prompt_rows=prompt_rows,
        )

    def _upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A step's index list as a tensor on the device: on the CPU built in place; on
        CUDA built in pinned memory and copied asynchronously (no host sync)."""
        if not self.pin:
            return torch.tensor(values, dtype=dtype, device=self.device)
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(self.device, non_blocking=True)

    def _decode_rows(self, scheduled: list) -> DecodeBatch | None:
        """A decode-only step's rows for the CUDA graphs (None: nothing to decode)."""
        if not scheduled:
            return None
        bs = self.block_size
        context = [s.start + 1 for s in scheduled]
        width = -(-max(context) // bs)
        return DecodeBatch(
            input_ids=[s.request.all_token_ids[s.start] for s in scheduled],
            positions=[s.start for s in scheduled],
            slots=[s.block_ids[s.start // bs] * bs + s.start % bs for s in scheduled],
            tables=[
                s.block_ids[:width] + [0] * (width - len(s.block_ids[:width])) for s in scheduled
            ],
            context_lens=context,
        )


_EMPTY = torch.empty(0, dtype=torch.int64)  # ModelInput fields a replayed graph does not use


def _flex_decode(kv_cache: KVCache, max_seqs: int, device: torch.device) -> FlexDecode | None:
    """FlexAttention decode over this cache, tried once on a one-row batch (this compiles
    it); None, with the reason logged, where it does not run: decodes then gather."""
    try:
        flex = FlexDecode(kv_cache.num_blocks, kv_cache.block_size, max_seqs, device)
        k, v = kv_cache.layers[0]
        flex.write(
            torch.zeros(1, 1, dtype=torch.int32, device=device),
            torch.ones(1, dtype=torch.int32, device=device),
        )
        q = torch.zeros(1, k.shape[2], k.shape[3], dtype=k.dtype, device=device)
        flex.step(1)(q, k, v, 1.0)
        torch.cuda.synchronize(device)
        return flex
    except Exception as exc:  # an old PyTorch, or a block size the kernel refuses
        log.warning("FlexAttention decode unavailable on %s (%s): gathering K/V", device, exc)
        return None


def _move(meta: AttentionMetadata, device: torch.device, pinned: bool) -> None:
    """Index tensors are built on the host (pinned on CUDA); the device needs them on its
    side. Copies from pinned memory are asynchronous; from pageable memory they are not."""
    meta.slot_mapping = meta.slot_mapping.to(device, non_blocking=True)
    if meta.decode_block_tables is not None and meta.decode_mask is not None:
        meta.decode_block_tables = _pinned(meta.decode_block_tables, pinned).to(
            device, non_blocking=True
        )
        meta.decode_mask = _pinned(meta.decode_mask, pinned).to(device, non_blocking=True)
    for p in meta.prefills:
        if p.block_table is not None:
            p.block_table = _pinned(p.block_table, pinned).to(device, non_blocking=True)
        if p.mask is not None:
            p.mask = _pinned(p.mask, pinned).to(device, non_blocking=True)


def _pinned(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    return t.pin_memory() if pinned else t
