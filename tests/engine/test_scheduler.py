"""The scheduler alone: no model, no runner. Each "step" schedules, marks the scheduled
tokens computed (update), and hands a made-up token to each request that samples."""

from app.config import SchedulerConfig
from app.engine.block_pool import BlockPool
from app.engine.kv_manager import KVCacheManager
from app.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from app.engine.scheduler import Accepted, Scheduler, SchedulerOutput

BS = 4  # tokens per block


def make(num_blocks=64, **cfg) -> Scheduler:
    defaults = dict(
        max_num_seqs=8, max_num_batched_tokens=32, prefill_chunk_while_decoding=32,
        batching="static",
    )  # fmt: skip
    defaults.update(cfg)
    return Scheduler(SchedulerConfig(**defaults), KVCacheManager(BlockPool(num_blocks), BS))


def request(rid: str, n: int, max_tokens: int = 8, first: int = 1000) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(), max_tokens)


def step(s: Scheduler) -> SchedulerOutput:
    """Schedule, pretend the model ran, sample token 7 for whoever samples."""
    out = s.schedule()
    s.update(out)
    for item in out.scheduled:
        req = item.request
        if item.samples:
            reason = s.accept(req, 7).reason  # the scheduler's own token-level stops
            if reason is not None:
                s.finish(req, reason)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(x.request.request_id, x.start, x.num_tokens) for x in out.scheduled]


def test_decodes_first_then_prefills_then_admissions_within_the_budget():
    s = make(prefill_chunk_while_decoding=32)
    s.add(request("a", 10))
    s.add(request("b", 40, first=2000))
    assert plan(step(s)) == [("a", 0, 10), ("b", 0, 22)]  # a fits whole, b gets the rest
    s.add(request("c", 5, first=3000))
    # a decodes, b continues its prompt, c waits for the budget left.
    assert plan(step(s)) == [("a", 10, 1), ("b", 22, 18), ("c", 0, 5)]
    assert all(x.num_tokens == 1 for x in step(s).scheduled)  # everyone decodes now


def test_the_step_is_a_snapshot_that_update_does_not_change():
    s = make()
    s.add(request("a", 10))
    out = s.schedule()
    before = plan(out), [x.samples for x in out.scheduled], [x.is_decode for x in out.scheduled]
    s.update(out)
    assert (
        plan(out),
        [x.samples for x in out.scheduled],
        [x.is_decode for x in out.scheduled],
    ) == before
    assert out.scheduled[0].request.num_computed_tokens == 10


def test_a_chunk_that_stops_short_of_the_prompt_end_does_not_sample():
    s = make(max_num_batched_tokens=8)
    s.add(request("a", 9))
    first = step(s)
    assert plan(first) == [("a", 0, 8)] and not first.scheduled[0].samples
    second = step(s)
    only = second.scheduled[0]
    assert (only.start, only.num_tokens, only.samples) == (8, 1, True)
    assert only.is_decode  # its last prompt token: attended like a decode, and sampled
    assert s.running[0].output_token_ids == [7]


def test_prefill_is_capped_while_others_decode():
    s = make(max_num_batched_tokens=64, prefill_chunk_while_decoding=6)
    s.add(request("a", 4))
    step(s)
    s.add(request("b", 50, first=2000))
    assert plan(step(s)) == [("a", 4, 1), ("b", 0, 6)]


def test_max_num_seqs_bounds_the_batch():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        s.add(request(f"r{i}", 3, first=1000 * (i + 1)))
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    assert len(s.waiting) == 2


def test_out_of_blocks_the_newest_is_preempted_and_requeued_first():
    s = make(num_blocks=7, max_num_batched_tokens=64)  # 6 usable blocks of 4 tokens
    s.add(request("old", 11, max_tokens=20))
    s.add(request("new", 11, max_tokens=20, first=5000))
    step(s)  # 3 + 3 blocks: the pool is full
    step(s)  # the 12th token still fits each one's third block
    out = step(s)  # old's 13th needs a fourth: the newest request goes
    assert out.preempted == ["new"]
    assert [r.request_id for r in s.running] == ["old"]
    assert s.waiting[0].request_id == "new" and s.waiting[0].status is RequestStatus.WAITING
    assert s.waiting[0].num_computed_tokens == 0 and s.stats.num_preemptions == 1
    s.kv.check_integrity()


def test_a_prefix_hit_is_skipped_and_counted_once():
    s = make()
    s.add(request("a", 12, max_tokens=1))
    step(s)  # a finishes; its 3 full blocks stay cached
    s.add(request("b", 14, max_tokens=1))  # same first 12 tokens, then 2 more
    out = step(s)
    assert plan(out) == [("b", 12, 2)]
    assert s.stats.prefix_queries == 26 and s.stats.prefix_hits == 12


def test_token_level_stops_are_the_schedulers():
    s = make()
    req = Request("r", [1, 2, 3], SamplingParams(stop_token_ids=(9,)), 3)
    assert s.accept(req, 7) == Accepted(7, False, None)
    assert s.accept(req, 9).reason is FinishReason.STOP  # a stop token
    req = Request("r", [1, 2, 3], SamplingParams(), 2)
    s.accept(req, 7)
    assert s.accept(req, 7).reason is FinishReason.LENGTH  # max_tokens
    s.max_model_len = 5
    req = Request("r", [1, 2, 3], SamplingParams(), 10)
    assert s.accept(req, 7).reason is None
    assert s.accept(req, 7).reason is FinishReason.LENGTH  # the context is full
    req = Request("r", [1, 2], SamplingParams(), 4)
    req.replay_ids = (5, 6)
    assert s.accept(req, 7) == Accepted(5, True, None)  # the replayed token, not the sampled
    assert req.output_token_ids == [5]
