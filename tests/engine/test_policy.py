"""Adaptive batching: the cost model's fit, budgets from a latency target, earliest deadline
first with its starvation bound (on a deterministic cost model and arrival times), and the
real engine reacting to a long prompt beside decodes."""

import random

import pytest

from app.config import SchedulerConfig
from app.engine.cost_model import MIN_STEPS, StepCostModel, StepShape
from app.engine.engine_request import EngineRequest
from app.engine.outputs import ITL_OVER
from app.engine.policy import (
    AUTO_TARGET_FACTOR,
    MARGIN_QUANTILE,
    MIN_CHUNK,
    MIN_MARGIN_STEPS,
    SLACK_MULTIPLE,
    AdaptivePolicy,
    StaticPolicy,
)
from app.engine.request import Request, SamplingParams, Timings
from tests.engine.util import run
from tests.tiny import tiny_engine

TRUE = (0.004, 0.002, 0.0008, 2e-7)  # fixed, per decode, per prefill token, per context row


def true_time(shape: StepShape) -> float:
    return sum(c * f for c, f in zip(TRUE, shape.features()))


def fitted(noise: float = 0.0, steps: int = 300) -> StepCostModel:
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(steps):
        shape = StepShape(rng.randrange(0, 33), rng.randrange(0, 512), rng.randrange(0, 60_000))
        model.observe(shape, true_time(shape) * (1 + rng.uniform(-noise, noise)))
    return model


def test_the_cost_model_learns_a_linear_step_time():
    model = fitted()
    assert model.steps_seen > MIN_STEPS
    for got, want in zip(model.coef, TRUE):
        assert got == pytest.approx(want, rel=1e-3)
    noisy = fitted(noise=0.1)
    assert noisy.abs_error < 0.1  # reported: the mean relative error of its predictions


def policy(target_ms=50.0, max_num_seqs=16, cost=None) -> AdaptivePolicy:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, itl_target_ms=target_ms, batching="adaptive")
    return AdaptivePolicy(cfg, cost or fitted())


def test_beside_decodes_a_chunk_fills_the_step_up_to_the_target():
    p = policy(target_ms=50.0)
    step = StepShape().plus_decode(500).plus_decode(800)
    n = p.prefill_tokens(step, computed=0, remaining=2000, budget=2048)
    assert true_time(step.plus_prefill(n, 0)) <= 0.050 < true_time(step.plus_prefill(n + 1, 0))
    # Deeper into the prompt each token attends to more: smaller chunks.
    deeper = p.prefill_tokens(step, computed=1500, remaining=500, budget=2048)
    assert deeper < n


def test_nothing_decoding_means_the_whole_budget():
    p = policy(target_ms=1.0)
    assert p.prefill_tokens(StepShape(), 0, 2000, 2048) == 2000
    assert p.prefill_tokens(StepShape(), 0, 5000, 2048) == 2048


def test_a_prompt_always_progresses_and_a_deep_queue_keeps_the_target():
    p = policy(target_ms=1.0, max_num_seqs=16)  # decodes alone exceed the target
    step = StepShape().plus_decode(100)
    assert p.prefill_tokens(step, 0, 1000, 2048) == MIN_CHUNK
    # One prompt a step is owed its MIN_CHUNK, not every one: k prompts under way would
    # otherwise add k bites to a step already over the target.
    assert p.prefill_tokens(step.plus_prefill(MIN_CHUNK, 0), 0, 1000, 2048) == 0
    # The target is a promise to those decoding: the queue's depth does not stretch it.
    p = policy(target_ms=50.0, max_num_seqs=16)
    n = p.prefill_tokens(step, 0, 5000, 4096)
    assert true_time(step.plus_prefill(n, 0)) <= 0.050


def test_the_auto_target_follows_the_measured_decode_step():
    """AUTO_TARGET_FACTOR x the decode-only step: decodes a tenth of a step, so prompts
    computed beside them keep ~90% of their rate alone."""
    p = policy(target_ms=None)
    decode_only = StepShape().plus_decode(100)
    for _ in range(20):
        p.observe(decode_only, 0.010)
    assert p.itl_target_s() == pytest.approx(AUTO_TARGET_FACTOR * 0.010)
    step = decode_only.plus_decode(100)
    n = p.prefill_tokens(step, computed=0, remaining=5000, budget=4096)
    assert true_time(step) / true_time(step.plus_prefill(n, 0)) < 0.15


def test_chunks_are_planned_with_the_models_observed_overrun():
    """Steps carrying a chunk beside decodes that run longer than predicted (here, by 0
    to 25%) shrink later chunks until the slow ones fit the target too: the margin is the
    MARGIN_QUANTILE of measured / predicted."""
    p = policy(target_ms=50.0)
    step = StepShape().plus_decode(500).plus_decode(800)
    planned = p.prefill_tokens(step, computed=0, remaining=2000, budget=2048)
    assert p.margin == 1.0
    rng = random.Random(1)
    for i in range(MIN_MARGIN_STEPS + 40):
        shape = step.plus_prefill(planned, 0)
        p.observe(shape, true_time(shape) * (1 + rng.uniform(0.0, 0.25)))
        assert (p.margin == 1.0) == (i + 1 < MIN_MARGIN_STEPS)
    assert p.margin == pytest.approx(1 + 0.25 * MARGIN_QUANTILE, abs=0.04)
    n = p.prefill_tokens(step, computed=0, remaining=2000, budget=2048)
    assert n < planned
    assert true_time(step.plus_prefill(n, 0)) * p.margin <= 0.050
    # Decode-only steps and prompts alone do not move it.
    margin = p.margin
    p.observe(step, true_time(step) * 3)
    p.observe(StepShape().plus_prefill(500, 0), 9.0)
    assert p.margin == margin


def request(rid: str, n: int, arrival: float, preempted: int = 0) -> Request:
    r = Request(rid, list(range(n)), SamplingParams(), 8)
    r.timings = Timings(arrival=arrival)
    r.num_preemptions = preempted
    return r


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_a_short_prompt_passes_a_long_one_that_arrived_shortly_before():
    p = policy()
    waiting = [request("long", 2000, 0.0), request("short", 30, 0.1), request("mid", 300, 0.2)]
    assert ids(p.prefill_order([], waiting)) == ["short", "mid", "long"]
    # Prompts of one size: first come, first served.
    same = [request("a", 500, 0.0), request("b", 500, 0.1), request("c", 500, 0.2)]
    assert ids(p.prefill_order([], same)) == ["a", "b", "c"]


def test_a_preempted_request_goes_first():
    p = policy()
    waiting = [request("back", 900, 0.0, preempted=1), request("short", 30, 0.1)]
    assert ids(p.prefill_order([], waiting)) == ["back", "short"]


def test_prompts_under_way_and_waiting_ones_share_one_order():
    """A paste under way does not hold a question that just arrived to what the step has
    left: the question goes first until its deadline is later than the paste's."""
    p = policy()
    paste = request("paste", 2000, 0.0)
    paste.num_computed_tokens = 200
    question = request("question", 60, 0.5)
    assert ids(p.prefill_order([paste], [question])) == ["question", "paste"]
    late = request("late", 60, p.deadline(paste) + 0.01)
    assert ids(p.prefill_order([paste], [late])) == ["paste", "late"]
    # The static policy: prompts under way in admission order, then the queue in arrival order.
    static = StaticPolicy(SchedulerConfig(batching="static"))
    assert ids(static.prefill_order([paste], [question])) == ["paste", "question"]


def test_no_request_starves_behind_a_stream_of_short_ones():
    """A long prompt among short ones arriving without end, one request served every
    50 ms: it is passed only by requests that arrived within SLACK_MULTIPLE x its own
    prefill time after it, so it is served within that window (plus one service)."""
    p = policy()
    long = request("long", 2000, 0.0)
    window = p.deadline(long) - long.timings.arrival
    assert window == pytest.approx(
        SLACK_MULTIPLE * true_time(StepShape(0, 2000, 2000**2 // 2)), rel=0.01
    )
    waiting = [long]
    now, served_at, passed_by = 0.0, None, []
    for i in range(10_000):
        now += 0.05
        waiting.append(request(f"s{i}", 20, now))
        chosen = p.prefill_order([], waiting)[0]
        waiting.remove(chosen)
        if chosen is long:
            served_at = now
            break
        passed_by.append(chosen)
    assert served_at is not None and served_at <= window + 0.05
    assert served_at > 1.0  # it did let short ones pass first
    assert all(r.timings.arrival <= window for r in passed_by)


def test_the_real_engine_cuts_a_long_prompt_beside_decodes(tokenizer):
    """A tiny engine with a target far below any step: beside decodes, a long prompt
    arrives in MIN_CHUNK bites; the replies are those of each prompt alone."""
    engine = tiny_engine(tokenizer, batching="adaptive", max_num_batched_tokens=256)
    engine.scheduler.policy.cfg = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=256, batching="adaptive", itl_target_ms=1e-3
    )
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request(EngineRequest(list(range(100, 140)), params, "talk"))
    engine.step()  # its prompt, alone: the whole thing at once
    chunks = []
    real = engine.runner.run

    def spy(sched):
        chunks.extend(s.num_tokens for s in sched.scheduled if s.request.request_id == "paste")
        return real(sched)

    engine.runner.run = spy
    engine.add_request(EngineRequest(list(range(1000, 1200)), params, "paste"))
    res = run(engine)
    assert chunks[0] == MIN_CHUNK and max(chunks) < 200
    assert res["paste"].finish_reason == "length"
    report = engine.stats().step  # what /metrics shows of the last step
    assert report.measured_s > 0 and report.predicted_s >= 0
    assert report.itl_target_s == pytest.approx(1e-6) and report.itl_margin >= 1.0
    # Every gap the engine saw was over a target of 1 us, at every multiple counted.
    stats = engine.stats()
    assert stats.itl_gaps >= 2 * 29 and stats.itl_gaps_over == (stats.itl_gaps,) * len(ITL_OVER)
    alone = tiny_engine(tokenizer, batching="static")
    alone.add_request(EngineRequest(list(range(1000, 1200)), params, "paste"))
    assert run(alone)["paste"].token_ids == res["paste"].token_ids
    assert alone.stats().itl_gaps == 0  # no target, nothing held against one


def test_a_question_is_admitted_ahead_of_a_paste_under_way(tokenizer):
    """In the real scheduler: beside a decode, with a target that leaves room for one
    MIN_CHUNK, a question that arrives while a paste is being computed takes that chunk
    (admitted in the paste's place) and the paste waits for the question's prompt."""
    engine = tiny_engine(tokenizer, batching="adaptive", max_num_batched_tokens=256)
    engine.scheduler.policy.cfg = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=256, batching="adaptive", itl_target_ms=1e-3
    )
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request(EngineRequest(list(range(100, 140)), params, "talk"))
    engine.step()  # its prompt, alone
    engine.add_request(EngineRequest(list(range(1000, 1200)), params, "paste"))
    engine.step()
    engine.step()  # the paste under way, MIN_CHUNK a step
    engine.add_request(EngineRequest(list(range(300, 340)), params, "question"))
    # Deadlines are arrival + predicted prefill: the question arrived just after the paste
    # began, however slowly this (shared) machine ran the steps in between.
    paste = engine.requests["paste"].timings
    engine.requests["question"].timings.arrival = paste.arrival + 1e-3
    steps = []
    real = engine.runner.run

    def spy(sched):
        steps.append({s.request.request_id: s.num_tokens for s in sched.scheduled})
        return real(sched)

    engine.runner.run = spy
    res = run(engine)
    assert steps[0] == {"talk": 1, "question": MIN_CHUNK}
    assert steps[2] == {"talk": 1, "question": 40 - 2 * MIN_CHUNK}
    assert steps[3]["paste"] == MIN_CHUNK
    assert {r.finish_reason for r in res.values()} == {"length"}
