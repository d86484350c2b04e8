"""One request's failure stays that request's: the others go on, the pool stays whole."""

import time

from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from tests.engine.test_engine import generate, prompts
from tests.engine.util import all_free, run
from tests.tiny import tiny_engine

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
POISON = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, seed=666)


def test_a_failing_sampler_row_fails_only_its_request(tokenizer):
    ps = prompts(4)
    clean = [r.token_ids for r in generate(tiny_engine(tokenizer), ps, PARAMS)]
    engine = tiny_engine(tokenizer)
    real = engine.runner.sampler

    def sampler(logits, states, masks=None):
        if any(s.params.seed == 666 for s in states):
            raise RuntimeError("boom")
        return real(logits, states)

    engine.runner.sampler = sampler
    for i, p in enumerate(ps):
        engine.add_request(EngineRequest(p, PARAMS, f"r{i}"))
    engine.add_request(EngineRequest(prompts(1, seed=9)[0], POISON, "bad"))
    res = run(engine)
    assert res["bad"].finish_reason == "error"
    assert [res[f"r{i}"].token_ids for i in range(4)] == clean
    assert all_free(engine)


def test_a_failing_detokenizer_fails_only_its_request(tokenizer):
    engine = tiny_engine(tokenizer)
    for i, p in enumerate(prompts(3)):
        engine.add_request(EngineRequest(p, PARAMS, f"r{i}"))

    def broken(ids):
        raise UnicodeError("cannot decode")

    engine.requests["r1"].detokenizer.add_tokens = broken
    res = run(engine)
    assert res["r1"].finish_reason == "error"
    assert res["r0"].finish_reason == res["r2"].finish_reason == "length"
    assert all_free(engine)


def test_requests_over_their_time_limit_stop(tokenizer):
    engine = tiny_engine(tokenizer, request_timeout_s=0.05)
    long = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    engine.add_request(EngineRequest(prompts(1)[0], long, "slow"))
    engine.step()
    time.sleep(0.1)
    engine._next_housekeeping = 0  # the next step runs the once-a-second chores
    res = run(engine)
    assert res["slow"].finish_reason == "timeout" and all_free(engine)
