"""A request that replays the tokens another produced (EngineRequest.replay_ids) goes on
exactly as that one would have: each replayed token is fed back by a decode step, as it
was first decoded, so the K/V, the sampler's random stream and the detokenizer all end
where an uninterrupted run's did. How a turn resumed after a restart keeps its reply (a
prefill of the same tokens rounds differently in bf16; docs/determinism.md has how
closely replay holds there)."""

import pytest

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.errors import BadParameter
from app.engine.request import SamplingParams
from tests.engine.util import run
from tests.tiny import tiny_engine


@pytest.mark.parametrize("cut", [1, 9])
def test_a_seeded_reply_replayed_goes_on_as_the_first(tokenizer, cut):
    engine = tiny_engine(tokenizer)
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    engine.add_request(EngineRequest(prompt, params, "whole"))
    whole = run(engine)["whole"]

    engine.add_request(EngineRequest(prompt, params, "rest", replay_ids=whole.token_ids[:cut]))
    rest = run(engine)["rest"]
    # Outputs start after the replayed tokens; the text goes on where it was cut.
    assert rest.token_ids == whole.token_ids[cut:]
    assert whole.text.endswith(rest.text) and rest.text
    assert rest.finish_reason == "length"


def test_replayed_tokens_replace_what_the_sampler_picks(tokenizer):
    """Tokens the model would not pick are replayed as given: the reply goes on from them."""
    engine = tiny_engine(tokenizer)
    prompt = tokenizer.encode("The sea", add_special_tokens=False)
    forced = tuple(tokenizer.encode(" purple elephants", add_special_tokens=False))
    greedy = SamplingParams(temperature=0, max_tokens=len(forced) + 6, ignore_eos=True)
    engine.add_request(EngineRequest(prompt, greedy, "free"))
    engine.add_request(EngineRequest(prompt, greedy, "replay", replay_ids=forced))
    out = run(engine)
    assert out["free"].token_ids[: len(forced)] != list(forced)
    engine.add_request(EngineRequest(prompt + list(forced), SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), "prefilled"))  # fmt: skip
    assert out["replay"].token_ids == run(engine)["prefilled"].token_ids  # fp32: same


@pytest.mark.parametrize(
    "replay_ids, params",
    [
        ((1, -2), {}),
        ((1, 2), dict(n=2)),
        ((1, 2), dict(logprobs=1)),
        ((1, 2), dict(max_tokens=2)),
    ],
)
def test_replay_ids_are_validated(replay_ids, params):
    with pytest.raises(BadParameter) as bad:
        EngineRequest([5], SamplingParams(**params), replay_ids=replay_ids)
    assert bad.value.name == "replay_ids"


def test_replay_ids_outside_the_vocabulary_are_refused(tokenizer):
    engine = tiny_engine(tokenizer)
    with pytest.raises(BadParameter, match="replay_ids"):
        engine.add_request(EngineRequest([1, 2], SamplingParams(), "x", replay_ids=(10**7,)))
    assert not engine.has_unfinished_requests()


def test_replay_is_exact_on_the_default_format(smollm):
    """The default (int4 weights, bf16 activations where the CPU has them): greedy replies
    cut at several points and replayed beside other requests equal the whole ones."""
    engine = LLMEngine(EngineConfig(ModelConfig(), CacheConfig(256 << 20)), smollm)
    tok = smollm.tokenizer
    questions = ("Describe a lighthouse at night.", "What do bees do in winter?")
    chats = [[{"role": "user", "content": q}] for q in questions]
    ids = [
        list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False))
        for c in chats
    ]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(ids):
        engine.add_request(EngineRequest(prompt, params, f"whole{i}"))
    whole = run(engine)
    for i, prompt in enumerate(ids):
        cut = whole[f"whole{i}"].token_ids[: 11 + 13 * i]
        engine.add_request(EngineRequest(prompt, params, f"rest{i}", replay_ids=cut))
    rest = run(engine)
    for i in range(len(ids)):
        assert rest[f"rest{i}"].token_ids == whole[f"whole{i}"].token_ids[11 + 13 * i :]
