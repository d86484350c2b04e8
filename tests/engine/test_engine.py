"""LLMEngine on a tiny random model: scheduling, caching, preemption, abort, stops."""

import pytest
import torch

import tests.tiny
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.model.packed_linear import PackedLinear, packable
from tests.engine.util import all_free, run
from tests.tiny import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n: int, length: int = 40, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length + 7 * i)] for i in range(n)]


def generate(engine, ps, params=GREEDY, stagger: int = 0):
    ids = [f"r{i}" for i in range(len(ps))]

    def add(step):
        for i, (rid, p) in enumerate(zip(ids, ps)):
            if i * stagger == step:
                engine.add_request(EngineRequest(p, params, rid))

    res = run(engine, before_step=add)
    return [res[i] for i in ids]


@pytest.fixture
def reference(tokenizer):
    """Each prompt alone on a roomy engine: the uninterrupted greedy tokens."""
    cache = {}

    def get(ps, params=GREEDY):
        key = (tuple(map(tuple, ps)), params)
        if key not in cache:
            cache[key] = []
            for p in ps:
                (r,) = generate(tiny_engine(tokenizer), [p], params)
                cache[key].append(r.token_ids)
        return cache[key]

    return get


def test_batched_and_staggered_equal_alone(tokenizer, reference):
    ps = prompts(6)
    engine = tiny_engine(tokenizer)
    for stagger in (0, 3):
        got = generate(engine, ps, stagger=stagger)
        assert [r.token_ids for r in got] == reference(ps)
        assert all(r.finish_reason == "length" and len(r.token_ids) == 24 for r in got)
    assert all_free(engine)


def test_chunked_prefill_equals_one_shot(tokenizer, reference):
    ps = prompts(3, length=150)
    engine = tiny_engine(
        tokenizer, max_num_batched_tokens=32, max_num_seqs=4, prefill_chunk_while_decoding=8
    )
    got = generate(engine, ps, stagger=2)
    assert [r.token_ids for r in got] == reference(ps)


def test_prefill_logits_only_where_sampled(tokenizer):
    engine = tiny_engine(tokenizer, max_num_batched_tokens=32)
    engine.add_request(EngineRequest(prompts(1, length=100)[0], GREEDY, "a"))
    sched = engine.scheduler.schedule()
    inp = engine.runner.prepare(sched)
    assert inp.input_ids.numel() == 32 and inp.logits_indices.numel() == 0


def test_decodes_come_first_and_prefill_is_capped_while_decoding(tokenizer):
    engine = tiny_engine(tokenizer, max_num_batched_tokens=128, prefill_chunk_while_decoding=16)
    engine.add_request(EngineRequest(prompts(1, 20)[0], GREEDY, "a"))
    engine.step()  # a: whole prompt, samples its first token
    engine.add_request(EngineRequest(prompts(1, 300, seed=1)[0], GREEDY, "b"))
    sched = engine.scheduler.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in sched.scheduled] == [("a", 1), ("b", 16)]


def test_prefix_cache_hit_gives_same_tokens(tokenizer, reference):
    shared = prompts(1, length=200)[0]
    first, second = shared + [11, 12, 13], shared + [21, 22, 23, 24, 25]
    engine = tiny_engine(tokenizer)
    (r1,) = generate(engine, [first])
    (r2,) = generate(engine, [second])
    assert r1.cached_tokens == 0
    assert r2.cached_tokens == (len(shared) // 16) * 16
    assert r2.token_ids == reference([second])[0]


def test_identical_prompt_recomputes_only_its_last_token(tokenizer):
    p = prompts(1, length=64)[0]  # block aligned: 4 full blocks
    engine = tiny_engine(tokenizer)
    generate(engine, [p])
    (r,) = generate(engine, [p])
    assert r.cached_tokens == 48  # the last block holds the token whose logits we need


def test_a_request_may_opt_out_of_the_prefix_cache(tokenizer):
    p = prompts(1, length=64)[0]
    engine = tiny_engine(tokenizer)
    generate(engine, [p])
    engine.add(engine.make_request(EngineRequest(p, GREEDY, "x", use_prefix_cache=False)))
    assert run(engine)["x"].cached_tokens == 0
    (again,) = generate(engine, [p])
    assert again.cached_tokens == 48


def test_no_prefix_caching_means_no_hits(tokenizer):
    p = prompts(1, length=64)[0]
    engine = tiny_engine(tokenizer, prefix_caching=False)
    generate(engine, [p])
    (r,) = generate(engine, [p])
    assert r.cached_tokens == 0 and engine.kv.pool.num_cached_blocks == 0


def test_preempted_requests_resume_with_the_same_tokens(tokenizer, reference):
    ps = prompts(6, length=40)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    # 24 usable blocks of 16 tokens; six requests of ~100-160 tokens need ~45.
    engine = tiny_engine(tokenizer, num_blocks=25)
    got = generate(engine, ps, params)
    assert engine.scheduler.stats.num_preemptions > 0
    assert [r.token_ids for r in got] == reference(ps, params)
    assert all_free(engine)


def test_seeded_sampling_survives_preemption_and_batching(tokenizer):
    ps = prompts(4, length=30)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=50, ignore_eos=True)
    alone = [generate(tiny_engine(tokenizer), [p], params)[0].token_ids for p in ps]
    engine = tiny_engine(tokenizer, num_blocks=14)
    got = generate(engine, ps, params, stagger=1)
    assert engine.scheduler.stats.num_preemptions > 0
    assert [r.token_ids for r in got] == alone


@pytest.mark.parametrize("when", [0, 1, 5, 30])
def test_abort_any_mix_frees_everything(tokenizer, when):
    ps = prompts(8, length=60)
    engine = tiny_engine(tokenizer, num_blocks=40, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def step(i):
        if i == 0:
            for j, p in enumerate(ps):
                engine.add_request(EngineRequest(p, params, f"r{j}"))
        if i == when:
            for j in (0, 3, 4, 7):  # running, waiting, mid-prefill: whatever they are now
                assert engine.abort(f"r{j}")

    res = run(engine, before_step=step)
    assert {res[f"r{j}"].finish_reason for j in (0, 3, 4, 7)} == {"abort"}
    assert {res[f"r{j}"].finish_reason for j in (1, 2, 5, 6)} == {"length"}
    assert not engine.abort("r0")  # already gone
    assert all_free(engine)


def test_max_num_seqs_is_respected(tokenizer):
    engine = tiny_engine(tokenizer, max_num_seqs=3)
    for j, p in enumerate(prompts(7, 10)):
        engine.add_request(EngineRequest(p, GREEDY, f"r{j}"))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3


def test_eos_and_stop_token_ids_finish_with_stop(tokenizer):
    p = prompts(1)[0]
    engine = tiny_engine(tokenizer)
    (free_run,) = generate(engine, [p], SamplingParams(temperature=0, max_tokens=20))
    stop_at = free_run.token_ids[5]
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at])
    (r,) = generate(engine, [p], params)
    k = free_run.token_ids.index(stop_at)
    assert r.finish_reason == "stop" and r.token_ids == free_run.token_ids[: k + 1]
    assert r.text == tokenizer.decode(free_run.token_ids[:k], skip_special_tokens=True)


def test_stop_string_is_cut_exactly(tokenizer):
    p = prompts(1)[0]
    engine = tiny_engine(tokenizer)
    (free_run,) = generate(engine, [p], SamplingParams(temperature=0, max_tokens=30))
    text = free_run.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    (r,) = generate(engine, [p], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    assert r.finish_reason == "stop"
    assert r.text == text[: text.index(stop)]


def test_max_tokens_and_context_length(tokenizer):
    engine = tiny_engine(tokenizer, max_position_embeddings=64)
    (r,) = generate(engine, [prompts(1, 50)[0]], SamplingParams(max_tokens=100, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.token_ids) == 64 - 50


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "empty"), ([1] * 64, "context limit"), ([-1], "token ids"), ([10**9], "token ids")],
)
def test_bad_requests_raise_clear_errors(tokenizer, prompt, message):
    engine = tiny_engine(tokenizer, max_position_embeddings=64)
    with pytest.raises(ValueError, match=message):
        engine.add_request(EngineRequest(prompt, GREEDY, "x"))
    engine.add_request(EngineRequest([5, 6, 7], GREEDY, "ok"))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(EngineRequest([5, 6, 7], GREEDY, "ok"))
    res = run(engine)
    assert res["ok"].finish_reason == "length" and all_free(engine)


def test_prompt_larger_than_the_cache_is_refused(tokenizer):
    engine = tiny_engine(tokenizer, num_blocks=5)  # 4 usable blocks = 64 tokens
    with pytest.raises(ValueError, match="KV cache holds only 64 tokens"):
        engine.add_request(EngineRequest(prompts(1, 70)[0], GREEDY, "x"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_weights_and_cache(tokenizer, dtype):
    """ModelConfig.dtype: weights, activations and the K/V cache in 16 bits."""
    if tests.tiny.QUANTIZATION != "none":
        pytest.skip("quantized weights: their dtypes are tested with them")
    ps = prompts(3)
    engine = tiny_engine(tokenizer, dtype=dtype)
    assert engine.kv_cache.tensor.dtype == getattr(torch, dtype)
    if tests.tiny.DEVICE == "cpu" and packable(getattr(torch, dtype)):  # bf16 kernels: packed
        assert isinstance(engine.model.layers[0].qkv, PackedLinear)
    got = generate(engine, ps, GREEDY)
    full = generate(tiny_engine(tokenizer), ps, GREEDY)
    assert all(r.finish_reason == "length" for r in got)
    # Well-spread logits: 16-bit rounding does not change the first greedy tokens.
    assert [r.token_ids[:4] for r in got] == [r.token_ids[:4] for r in full]


def test_prefix_counters_count_each_request_once_through_preemptions(tokenizer):
    """Re-admission after a preemption finds the request's own freed blocks: not a cache
    hit, and not a second query (the hit rate in /metrics stays true under pressure)."""
    ps = prompts(6, length=40)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine = tiny_engine(tokenizer, num_blocks=25)
    got = generate(engine, ps, params)
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert stats.prefix_queries == sum(len(p) for p in ps)
    assert stats.prefix_hits + stats.pin_hits == sum(r.cached_tokens for r in got) == 0
