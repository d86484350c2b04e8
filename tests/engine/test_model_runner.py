"""ModelRunner.prepare alone: a SchedulerOutput in, flat tensors and attention metadata
out; no model runs."""

import torch

from app.config import CacheConfig
from app.engine.kv_cache import KVCache
from app.engine.model_runner import ModelRunner
from app.engine.request import Request, SamplingParams
from app.engine.sampler import Sampler
from app.engine.scheduler import ScheduledRequest, SchedulerOutput
from tests.tiny import tiny_arch

BS = 4


def runner() -> ModelRunner:
    arch = tiny_arch(100)
    per_block = 2 * arch.num_layers * BS * arch.kv_size * 4
    cache = KVCache(arch, CacheConfig(kv_cache_bytes=16 * per_block, block_size=BS))
    return ModelRunner(model=None, kv_cache=cache, sampler=Sampler())  # type: ignore[arg-type]


def scheduled(rid, tokens, start, n, blocks) -> ScheduledRequest:
    req = Request(rid, tokens, SamplingParams(), 4)
    return ScheduledRequest(req, start, n, start + n == len(tokens), blocks)


def test_decodes_come_first_and_only_sampling_rows_get_logits():
    decode = scheduled("d", list(range(10)), 9, 1, [3, 5, 7])  # 10th token, third block
    fresh = scheduled("f", list(range(6)), 0, 6, [1, 2])  # a whole prompt: samples
    part = scheduled("p", list(range(20)), 0, 8, [4, 6, 8, 9, 10])  # a chunk: does not
    inp = runner().prepare(SchedulerOutput([fresh, decode, part]))
    assert inp.meta.num_decodes == 1
    assert inp.input_ids.tolist() == [9, *range(6), *range(8)]
    assert inp.positions.tolist() == [9, *range(6), *range(8)]
    # slot = block * block_size + offset
    assert inp.meta.slot_mapping.tolist() == [7 * BS + 1, 4, 5, 6, 7, 8, 9, 16, 17, 18, 19, 24,
                                              25, 26, 27]  # fmt: skip
    assert inp.logits_indices.tolist() == [0, 6]  # the decode, the end of the fresh prompt
    assert [r.request_id for r in inp.sampling_requests] == ["d", "f"]
    mask = inp.meta.decode_mask  # additive: 0 = attend, -inf = past the context
    assert mask.shape[-1] == 3 * BS and (mask[0, 0, 0] == 0).tolist() == [True] * 10 + [False] * 2
    assert mask.dtype == torch.float32  # the cache's: SDPA adds it as it is
    assert mask[0, 0, 0, -1] == float("-inf")


def test_several_decodes_share_one_padded_masked_gather():
    a = scheduled("a", list(range(10)), 9, 1, [3, 5, 7])
    b = scheduled("b", list(range(5)), 4, 1, [2, 4])
    inp = runner().prepare(SchedulerOutput([a, b]))
    assert inp.meta.decode_block_tables.tolist() == [[3, 5, 7], [2, 4, 0]]
    mask = inp.meta.decode_mask == 0
    assert mask.shape[-1] == 3 * BS and mask[0, 0, 0].tolist() == [True] * 10 + [False] * 2
    assert mask[1, 0, 0].tolist() == [True] * 5 + [False] * 7


def test_a_chunk_after_a_cached_prefix_attends_through_its_block_table():
    blocks = list(range(2, 19))  # 68 tokens past PAD_MAX_CONTEXT, in 17 blocks of 4
    chunk = scheduled("c", list(range(68)), 64, 4, blocks)
    inp = runner().prepare(SchedulerOutput([chunk]))
    (p,) = inp.meta.prefills
    assert p.block_table.tolist() == blocks and p.context_len == 68
    # Bottom-right causal: query i (position 64 + i) sees positions 0 .. 64 + i; additive,
    # once for each of the 2 query heads that share a K/V head (tiny: 4 heads, 2 K/V).
    expected = torch.arange(68)[None, :] <= torch.arange(64, 68)[:, None]
    assert p.mask.shape == (2 * 4, 68)
    assert torch.equal(p.mask == 0, expected.repeat(2, 1))
    assert torch.equal(p.mask != 0, p.mask == float("-inf"))
    assert inp.logits_indices.tolist() == [3]


def test_a_short_prompt_after_a_cached_prefix_attends_as_a_causal_square():
    chunk = scheduled("c", list(range(12)), 8, 4, [2, 3, 4])  # 12 <= PAD_MAX_CONTEXT
    (p,) = runner().prepare(SchedulerOutput([chunk])).meta.prefills
    assert p.block_table.tolist() == [2, 3, 4] and p.mask is None


def test_a_chunk_longer_than_its_cached_prefix_attends_as_a_causal_square():
    chunk = scheduled("c", list(range(12)), 4, 8, [2, 3, 4])
    (p,) = runner().prepare(SchedulerOutput([chunk])).meta.prefills
    assert p.block_table.tolist() == [2, 3, 4] and p.context_len == 12
    assert p.mask is None  # attention pads the 4 cached rows in and runs is_causal


def test_a_one_token_chunk_short_of_the_end_is_a_prefill_without_logits():
    edge = scheduled("e", list(range(10)), 8, 1, [1, 2, 3])
    assert not edge.is_decode
    inp = runner().prepare(SchedulerOutput([edge]))
    assert inp.meta.num_decodes == 0 and len(inp.meta.prefills) == 1
    assert inp.logits_indices.numel() == 0 and inp.sampling_requests == []


def test_a_step_is_built_on_the_cache_device():
    """On an accelerator every tensor of the step lives there (meta stands in for CUDA:
    building a step needs no data)."""
    arch = tiny_arch(100)
    per_block = 2 * arch.num_layers * BS * arch.kv_size * 4
    cache = KVCache(arch, CacheConfig(kv_cache_bytes=16 * per_block, block_size=BS), device="meta")
    r = ModelRunner(model=None, kv_cache=cache, sampler=Sampler())  # type: ignore[arg-type]
    decode = scheduled("d", list(range(10)), 9, 1, [3, 5, 7])
    cont = scheduled("c", list(range(68)), 64, 4, list(range(1, 18)))  # after a cached prefix
    inp = r.prepare(SchedulerOutput([cont, decode]))
    meta = inp.meta
    chunk = meta.prefills[0]
    tensors = [inp.input_ids, inp.positions, inp.logits_indices, meta.slot_mapping]
    tensors += [meta.decode_block_tables, meta.decode_mask, chunk.block_table, chunk.mask]
    assert all(t is not None and t.device.type == "meta" for t in tensors)


def test_the_sampler_keeps_logits_on_their_device():
    """Temperature, top-k, min-p, logit_bias and mixed greedy rows on meta logits: a tensor
    made on the host would raise here."""
    params = [
        SamplingParams(temperature=0.7, top_k=5, logit_bias=((3, 2.0),)),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, min_p=0.1),
    ]
    states = [Request(f"r{i}", [1, 2, 3], p, 4) for i, p in enumerate(params)]
    tokens = Sampler()(torch.randn(3, 50, device="meta"), states)
    assert tokens.device.type == "meta" and tokens.shape == (3,)
