"""Our decoder against transformers' LlamaForCausalLM on the real model (same GGUF)."""

from pathlib import Path

import pytest
import torch

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.model.registry import default_model_path
from tests.engine.util import run

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain continuous batching in two sentences.",
    "List three colors of the rainbow.",
    "Translate 'good morning, my friend' into Spanish, French and German.",
    "Write a haiku about autumn leaves.",
    "What is 17 times 23? Show your steps.",
    "Give me a short packing list for a weekend hiking trip.",
]
NEW_TOKENS = 64
TIE = 1e-4  # a divergence is excused only where the top-2 logits are this close


def summarize_prompt(tokenizer) -> list[int]:
    text = (Path(__file__).parent.parent / "data" / "lighthouses.txt").read_text()
    paragraphs = text.split("\n\n")[:5]
    msg = "Summarize this text:\n\n" + "\n\n".join(paragraphs)
    return chat_ids(tokenizer, msg)


def chat_ids(tokenizer, content: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
        )
    )


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ps = [chat_ids(tokenizer, q) for q in QUESTIONS]
    long = summarize_prompt(tokenizer)
    assert 550 <= len(long) <= 700
    return ps[:4] + [long] + ps[4:]


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    from app.config import default_cache_dir

    path = default_model_path(default_cache_dir())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    assert type(model).__name__ == "LlamaForCausalLM"
    return model.eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts, smollm):
    eos = sorted(smollm.eos_token_ids)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf_model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def engine_for(smollm, **cache) -> LLMEngine:
    exact = ModelConfig(quantization="none", dtype="float32")  # transformers runs fp32
    return LLMEngine(
        EngineConfig(model=exact, cache=CacheConfig(**cache), debug_checks=True), smollm
    )


def test_prefill_logits_match_transformers(smollm, hf_model, prompts):
    engine = engine_for(smollm, kv_cache_bytes=256 << 20)
    for p in prompts:
        engine.add_request(EngineRequest(p, SamplingParams(temperature=0, max_tokens=1), "p"))
        sched = engine.scheduler.schedule()
        inp = engine.runner.prepare(sched)
        with torch.no_grad():
            ours = engine.model(
                inp.input_ids,
                inp.positions,
                engine.kv_cache.layers,
                inp.meta,
                torch.arange(len(p)),  # every position, for the comparison
            )
            ref = hf_model(torch.tensor([p])).logits[0]
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-3, f"max |logit difference| {diff} on a {len(p)}-token prompt"
        engine.abort("p")
        engine.step()


def assert_same_greedy(hf_model, prompt, ours, ref):
    """Token-for-token equality, except after a position where HF's own top-2 logits
    tie within TIE (then either choice is right)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + ref[:i]])).logits[0, -1]
            top2 = logits.topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < TIE, f"diverged at token {i} ({a} vs {b}) with top-2 gap {gap}"
            return
    assert len(ours) == len(ref), f"lengths differ: {len(ours)} vs {len(ref)}"


def test_greedy_alone_equals_hf_generate(smollm, hf_model, prompts, hf_greedy):
    engine = engine_for(smollm, kv_cache_bytes=256 << 20, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    for p, ref in zip(prompts, hf_greedy):
        engine.add_request(EngineRequest(p, params, "alone"))
        got = run(engine)["alone"]
        assert_same_greedy(hf_model, p, got.token_ids, ref)


def test_greedy_together_staggered_equals_hf_generate(smollm, hf_model, prompts, hf_greedy):
    # Default scheduler: the long prompt arrives while others decode, so it is chunked
    # (prefill_chunk_while_decoding) and attends through the block table; the shared
    # system prompt comes from the prefix cache.
    engine = engine_for(smollm, kv_cache_bytes=256 << 20)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)

    def arrive(step):
        for i, p in enumerate(prompts):
            if step == 2 * i:
                engine.add_request(EngineRequest(p, params, f"r{i}"))

    res = run(engine, before_step=arrive)
    for i, (p, ref) in enumerate(zip(prompts, hf_greedy)):
        assert_same_greedy(hf_model, p, res[f"r{i}"].token_ids, ref)
    assert engine.scheduler.stats.prefix_hits > 0
