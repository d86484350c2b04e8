"""Logprobs of sampled and prompt tokens equal a reference computed from the model's own
logits over the same tokens (LlamaModel.forward_tokens, one plain causal pass)."""

import pytest
import torch

from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from tests.engine.util import run
from tests.tiny import tiny_engine


def reference(engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of `ids`: [len, V]."""
    with torch.inference_mode():
        return engine.model.forward_tokens(ids).float().log_softmax(-1)


def collect(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        engine.check_integrity()
    return outs


@pytest.mark.parametrize(
    "extra",
    [{}, {"temperature": 1.5, "seed": 3, "repetition_penalty": 1.3, "top_k": 5}],
    ids=["greedy", "sampled-with-penalties"],
)
def test_sampled_token_logprobs_match_the_model(tokenizer, extra):
    engine = tiny_engine(tokenizer)
    prompt = list(range(900, 925))
    params = SamplingParams(**{"temperature": 0, "max_tokens": 6, "logprobs": 4, **extra})
    engine.add_request(EngineRequest(prompt, params, "a"))
    engine.add_request(EngineRequest(list(range(50, 70)), SamplingParams(max_tokens=6), "free"))
    everything = collect(engine)
    assert all(o.logprobs is None for o in everything if o.request_id == "free")
    outs = [o for o in everything if o.request_id == "a"]
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp for o in outs for lp in o.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens
    ref = reference(engine, prompt + tokens)
    for i, lp in enumerate(logprobs):
        row = ref[len(prompt) - 1 + i]  # before penalties and temperature: the model's
        assert lp.logprob == pytest.approx(row[tokens[i]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(4).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(row.topk(4).values.tolist(), abs=1e-4)


def test_no_logprobs_unless_asked(tokenizer):
    engine = tiny_engine(tokenizer)
    engine.add_request(EngineRequest(list(range(10, 30)), SamplingParams(max_tokens=3), "a"))
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in collect(engine))


@pytest.mark.parametrize("cached_first", [False, True])
def test_scoring_a_prompt_with_max_tokens_0(tokenizer, cached_first):
    """echo + max_tokens 0: every prompt token but the first, in chunks, none of it taken
    from the prefix cache (that would have no logits)."""
    engine = tiny_engine(tokenizer, max_num_batched_tokens=512)
    prompt = [int(t) for t in torch.randint(100, 20000, (600,), generator=torch.Generator())]
    if cached_first:
        engine.add_request(EngineRequest(prompt, SamplingParams(max_tokens=1), "warm"))
        run(engine)
    engine.add_request(EngineRequest(prompt, SamplingParams(max_tokens=0, prompt_logprobs=2), "s"))
    outs = collect(engine)
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length"
    assert outs[0].completion_tokens == 0 and outs[0].new_token_ids == []
    scored = outs[0].prompt_logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    ref = reference(engine, prompt)
    got = torch.tensor([lp.logprob for lp in scored[1:]])
    want = ref[:-1].gather(1, torch.tensor(prompt[1:]).view(-1, 1)).view(-1)
    assert torch.allclose(got, want, atol=1e-4)
    assert [lp.token_id for lp in scored[1:]] == prompt[1:]
    assert [t for t, _ in scored[5].top] == ref[4].topk(2).indices.tolist()


def test_prompt_logprobs_with_generation_come_once(tokenizer):
    engine = tiny_engine(tokenizer)
    prompt = list(range(1000, 1040))
    engine.add_request(
        EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0), "e")
    )
    outs = collect(engine)
    with_prompt = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0] is outs[0]
    assert len(with_prompt[0].prompt_logprobs) == len(prompt)
    assert sum(len(o.new_token_ids) for o in outs) == 4


def test_max_tokens_0_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
