"""A seeded request continued by another (prompt + the tokens so far, `seed_offset` = their
number) samples exactly what the first would have: how a turn resumed after a restart
keeps its seeded reply."""

import pytest

from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from tests.engine.util import run
from tests.tiny import tiny_engine


@pytest.mark.parametrize("cut", [1, 7, 19])
def test_a_continued_seeded_request_samples_on_where_the_first_stopped(tokenizer, cut):
    engine = tiny_engine(tokenizer)
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    engine.add_request(EngineRequest(prompt, params, "whole"))
    whole = run(engine)["whole"].token_ids
    assert len(whole) == 24

    rest = SamplingParams(
        temperature=1.0, top_p=0.9, seed=1234, max_tokens=24 - cut, ignore_eos=True
    )
    engine.add_request(EngineRequest(prompt + whole[:cut], rest, "rest", seed_offset=cut))
    assert run(engine)["rest"].token_ids == whole[cut:]

    if cut > 1:
        return
    # Without the offset the continuation replays the seed's first draws: another reply.
    again = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24 - cut,
                           ignore_eos=True)  # fmt: skip
    engine.add_request(EngineRequest(prompt + whole[:cut], again, "again"))
    assert run(engine)["again"].token_ids != whole[cut:]


def test_seed_offset_is_validated():
    from app.engine.errors import BadParameter

    with pytest.raises(BadParameter) as bad:
        EngineRequest([1, 2], SamplingParams(seed=1), seed_offset=-1)
    assert bad.value.name == "seed_offset"
