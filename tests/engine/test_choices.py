"""n > 1: choices of one prompt share its blocks (fork, copy on write) and sample as the
separate requests seed, seed + 1, ... would."""

import pytest

from app.engine.engine_request import EngineRequest
from app.engine.errors import BadParameter
from app.engine.request import SamplingParams
from tests.engine.util import all_free, run
from tests.tiny import tiny_engine


def hot(seed: int = 7, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 3.0, "seed": seed, "max_tokens": 12, **kw})


def by_choice(engine, request_id: str) -> dict[int, list[int]]:
    """Step until idle; each choice's tokens."""
    tokens: dict[int, list[int]] = {}
    finished: set[int] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            assert out.index not in finished, "output after the choice's last"
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.index)
        engine.check_integrity()
    assert finished == set(tokens)
    return tokens


def separately(engine, prompt: list[int], n: int, **kw) -> list[list[int]]:
    for i in range(n):
        engine.add_request(EngineRequest(prompt, hot(7 + i, **kw), f"alone{i}"))
    res = run(engine)
    return [res[f"alone{i}"].token_ids for i in range(n)]


@pytest.mark.parametrize("prompt_len", [20, 32, 7])  # a partial last block, a full one
def test_choices_sample_as_separately_seeded_requests(tokenizer, prompt_len):
    engine = tiny_engine(tokenizer)
    prompt = list(range(300, 300 + prompt_len))
    engine.add_request(EngineRequest(prompt, hot(n=4), "g"))
    choices = by_choice(engine, "g")
    alone = separately(tiny_engine(tokenizer), prompt, 4)
    assert [choices[i] for i in range(4)] == alone
    assert len({tuple(c) for c in alone}) > 1, "the seeds should give different choices"
    assert all_free(engine)


def test_the_prompt_is_computed_once_and_stored_once(tokenizer):
    engine = tiny_engine(tokenizer, prefix_caching=False)
    prompt = list(range(400, 440))  # 2.5 blocks of 16
    computed, peak = 0, 0
    engine.add_request(EngineRequest(prompt, hot(n=4, max_tokens=3), "g"))
    while engine.has_unfinished_requests():
        sched = engine.scheduler.schedule
        out = sched()
        engine.scheduler.schedule = lambda out=out: out  # step() runs this very schedule
        computed += sum(s.num_tokens for s in out.scheduled if not s.is_decode)
        engine.step()
        engine.scheduler.schedule = sched
        pool = engine.kv.pool
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
    assert computed == len(prompt)
    # Two full blocks shared; the partial third one: the original plus a copy for each
    # of the three choices that wrote into it while it was shared.
    assert peak == 2 + 4
    assert all_free(engine)


def test_choices_survive_preemption(tokenizer):
    # 9 usable blocks: three choices of a 40-token prompt growing by 40 tokens need 11.
    engine = tiny_engine(tokenizer, num_blocks=10, max_num_seqs=4)
    prompt = list(range(600, 640))
    engine.add_request(EngineRequest(prompt, hot(n=3, max_tokens=40), "g"))
    choices = by_choice(engine, "g")
    assert engine.stats().num_preemptions > 0
    assert [choices[i] for i in range(3)] == separately(
        tiny_engine(tokenizer), prompt, 3, max_tokens=40
    )
    assert all_free(engine)


def test_abort_ends_every_choice_and_frees_the_blocks(tokenizer):
    engine = tiny_engine(tokenizer)
    engine.add_request(EngineRequest(list(range(700, 730)), hot(n=3, max_tokens=50), "g"))
    for _ in range(4):
        engine.step()
    assert engine.abort("g")
    outs = engine.step()
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
    assert all(o.finish_reason == "abort" for o in outs)
    assert not engine.requests and all_free(engine)
    engine.check_integrity()


def test_abort_before_the_prompt_is_computed(tokenizer):
    engine = tiny_engine(tokenizer, max_num_batched_tokens=16)
    engine.add_request(EngineRequest(list(range(700, 760)), hot(n=3), "g"))
    engine.step()  # the first chunk of the prompt only
    engine.abort("g")
    outs = engine.step()
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert not engine.requests and all_free(engine)


def test_choices_take_seats_within_max_num_seqs(tokenizer):
    engine = tiny_engine(tokenizer, max_num_seqs=4)
    engine.add_request(EngineRequest(list(range(10, 30)), hot(n=3, max_tokens=4), "a"))
    engine.add_request(EngineRequest(list(range(30, 50)), hot(n=2, max_tokens=4), "b"))
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        seen = max(seen, len(engine.scheduler.running))
        assert len(engine.scheduler.running) <= 4
    assert seen == 3  # "b" waited for "a": both would need 5 seats


def test_bad_n(tokenizer):
    engine = tiny_engine(tokenizer, max_num_seqs=4)
    for n, session in [(5, None), (2, "s"), (0, None), (2.0, None)]:
        with pytest.raises(BadParameter) as err:
            engine.make_request(EngineRequest([1, 2, 3], hot(n=n), session_id=session))
        assert err.value.name == "n"
