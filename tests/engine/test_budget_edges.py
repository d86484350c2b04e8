"""Batched = alone at the edges of the token budget: chunks of one token, prefix-cache hits
that leave a single prompt token, budgets that end exactly at a prompt's end."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from tests.engine.util import run
from tests.tiny import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


_ALONE: dict[tuple[int, ...], list[int]] = {}


def alone(tokenizer, prompt: list[int]) -> list[int]:
    """The prompt's greedy reply on a roomy engine, by itself."""
    key = tuple(prompt)
    if key not in _ALONE:
        engine = tiny_engine(tokenizer)
        engine.add_request(EngineRequest(prompt, GREEDY, "x"))
        _ALONE[key] = run(engine)["x"].token_ids
    return _ALONE[key]


def test_a_one_token_prefill_chunk_does_not_sample(tokenizer):
    """The issue's case: P's two full blocks are cached; beside A (31 tokens) in a
    32-token budget, P gets a 32-token hit and then a 1-token chunk that is not its last
    prompt token. It must not be sampled as if it were a decode."""
    p, a = tokens(40, seed=3), tokens(31, seed=4)
    engine = tiny_engine(tokenizer, max_num_batched_tokens=32, prefill_chunk_while_decoding=32)
    engine.add_request(EngineRequest(p, GREEDY, "warm"))
    run(engine)
    steps = []
    real_run = engine.runner.run

    def spy(sched):
        steps.append([(s.request.request_id, s.num_tokens, s.samples) for s in sched.scheduled])
        return real_run(sched)

    engine.runner.run = spy
    engine.add_request(EngineRequest(a, GREEDY, "a"))
    engine.add_request(EngineRequest(p, GREEDY, "p"))
    outputs = engine.step()
    assert steps[0] == [("a", 31, True), ("p", 1, False)]  # the edge is reached
    assert [o.request_id for o in outputs] == ["a"]  # nothing was sampled for p
    assert engine.requests["p"].output_token_ids == []
    res = run(engine)
    assert res["p"].token_ids == alone(tokenizer, p)
    assert outputs[0].new_token_ids + res["a"].token_ids == alone(tokenizer, a)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    budget=st.integers(4, 40),
    shared=st.sampled_from([0, 16, 32, 40]),
    tails=st.lists(st.integers(1, 24), min_size=2, max_size=4),
    warm=st.booleans(),
    batching=st.sampled_from(["static", "adaptive"]),
)
def test_any_budget_and_cached_prefix_equals_alone(
    tokenizer, budget, shared, tails, warm, batching
):
    """Prompts sharing a prefix, admitted together under a small budget, with or without
    the prefix already cached: every reply equals the prompt's reply alone."""
    prefix = tokens(shared, seed=1)
    prompts = [prefix + tokens(n, seed=10 + i) for i, n in enumerate(tails)]
    engine = tiny_engine(
        tokenizer,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        prefill_chunk_while_decoding=max(1, budget // 3),
        batching=batching,
    )
    if warm:
        engine.add_request(EngineRequest(prompts[0], GREEDY, "warm"))
        run(engine)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(p, GREEDY, f"r{i}"))
    res = run(engine)
    for i, p in enumerate(prompts):
        assert res[f"r{i}"].token_ids == alone(tokenizer, p), f"prompt {i} differs"
