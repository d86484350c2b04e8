"""Continuation alone: replay or prefill, the cut back to the text the caller had, the
request that goes on, and the usage kept as the cut request's."""

import dataclasses
from pathlib import Path

import pytest

from app.engine import continuation as continuation_module
from app.engine.continuation import REPLAY_MAX_TOKENS, Continuation
from app.engine.engine_request import EngineRequest
from app.engine.outputs import FinishedRequestStats, RequestOutput
from app.engine.request import FinishReason, SamplingParams, Timings

ESSAY = (Path(__file__).parent.parent / "data" / "essays.txt").read_text()
PROMPT = (1, 2, 3)


def output(prompt: int, cached: int, completion: int) -> RequestOutput:
    return RequestOutput("r", "x", [7], False, None, prompt, cached, completion, Timings())


def test_a_short_output_is_replayed_with_the_prompt_as_it_was():
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=300)
    cont = Continuation.of(PROMPT, [10, 11, 12], params)
    assert cont.replays and cont.kept_ids == (10, 11, 12) and cont.carried == 0
    asked = cont.request(EngineRequest(PROMPT, params, "r", session_id="s", cache_salt="t"))
    assert asked.prompt == PROMPT and asked.replay_ids == (10, 11, 12)
    assert asked.seed_offset == 0 and asked.params.max_tokens == 300  # replay counts in it
    assert (asked.request_id, asked.session_id, asked.cache_salt) == ("r", "s", "t")
    out = output(3, 2, 5)
    assert cont.output(out, cached_tokens=0) is out  # the engine's usage is the request's


def test_a_long_output_goes_into_the_prompt_and_its_usage_stays_the_requests():
    ids = list(range(100, 100 + REPLAY_MAX_TOKENS + 1))
    params = SamplingParams(seed=5, max_tokens=2000)
    cont = Continuation.of(PROMPT, ids, params)
    assert not cont.replays and cont.carried == len(ids) and cont.skip == 0
    asked = cont.request(EngineRequest(PROMPT, params, seed_offset=2))
    assert asked.prompt == PROMPT + tuple(ids) and asked.replay_ids == ()
    assert asked.params.max_tokens == 2000 - len(ids)
    assert asked.seed_offset == 2 + len(ids)  # the seed's stream moves on past them
    out = cont.output(output(3 + len(ids), 500, 4), cached_tokens=2)
    assert (out.prompt_tokens, out.cached_tokens, out.completion_tokens) == (3, 2, 4 + len(ids))
    stats = FinishedRequestStats("r", None, FinishReason.LENGTH, 3 + len(ids), 500, 4, 0, Timings())
    stats = cont.stats(stats, cached_tokens=2)
    assert (stats.num_prompt_tokens, stats.num_cached_tokens, stats.num_output_tokens) == (
        3, 2, 4 + len(ids)
    )  # fmt: skip


@pytest.mark.parametrize("asks", [dict(n=2), dict(logprobs=1), dict(prompt_logprobs=0)])
def test_what_cannot_replay_is_prefilled_however_short(asks):
    cont = Continuation.of(PROMPT, [10], SamplingParams(max_tokens=5, **asks))
    assert not cont.replays and cont.kept_ids == (10,) and cont.params.max_tokens == 4


def test_a_spent_budget_has_no_continuation(monkeypatch):
    assert Continuation.of(PROMPT, [10, 11], SamplingParams(max_tokens=3)) is not None
    assert Continuation.of(PROMPT, [10, 11], SamplingParams(max_tokens=2)) is None
    monkeypatch.setattr(continuation_module, "REPLAY_MAX_TOKENS", 0)  # the prefill's rule
    assert Continuation.of(PROMPT, [10, 11], SamplingParams(max_tokens=3)).params.max_tokens == 1
    assert Continuation.of(PROMPT, [10, 11], SamplingParams(max_tokens=2)) is None


def test_nothing_sent_is_the_request_as_it_was():
    params = SamplingParams(max_tokens=9)
    asked = EngineRequest(PROMPT, params, "r")
    cont = Continuation.of(PROMPT, [], params)
    assert cont.request(asked) == asked


def test_a_prefill_is_cut_back_to_the_text_the_caller_had(tokenizer):
    ids = tokenizer.encode(ESSAY, add_special_tokens=False)[: REPLAY_MAX_TOKENS + 40]
    shown = tokenizer.decode(ids)[:-7]  # the last characters held back (a stop string?)
    cont = Continuation.of(PROMPT, ids, SamplingParams(max_tokens=2000), shown,
                           tokenizer.decode)  # fmt: skip
    keep = len(cont.kept_ids)
    assert not cont.replays and 0 < keep < len(ids) and list(cont.kept_ids) == ids[:keep]
    decoded = tokenizer.decode(ids[:keep])
    assert shown.startswith(decoded)  # every kept token's text was shown...
    assert not shown.startswith(tokenizer.decode(ids[: keep + 1]))  # ...and no more
    assert cont.skip == len(shown) - len(decoded)  # shown again: skipped
    assert cont.params.max_tokens == 2000 - keep


def test_a_character_split_over_tokens_is_generated_again():
    # Byte-level tokens: the last two hold half a character each as far as the text goes.
    texts = {1: "a", 2: "ab", 3: "ab\ufffd", 4: "abé"}
    decode = lambda ids: texts[len(ids)] if ids else ""  # noqa: E731
    cont = Continuation.of(PROMPT, [1, 2, 3, 4], SamplingParams(n=2), "ab\ufffd", decode)
    assert cont.kept_ids == (1, 2) and cont.skip == 1
    cont = Continuation.of(PROMPT, [1, 2, 3, 4], SamplingParams(n=2), "zz", decode)
    assert cont.kept_ids == () and cont.skip == 2  # nothing in common: everything again


def test_the_value_is_frozen():
    cont = Continuation.of(PROMPT, [10], SamplingParams())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cont.skip = 3
