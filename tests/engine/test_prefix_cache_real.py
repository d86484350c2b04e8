"""The prefix cache on the real model: a request that shares a long prefix with an earlier
finished one reads it from cache and says exactly what it would have said without."""

from pathlib import Path

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.engine import LLMEngine
from app.engine.request import SamplingParams
from tests.engine.util import run

TEXT = (Path(__file__).parent.parent / "data" / "lighthouses.txt").read_text().split("\n\n")
PARAMS = SamplingParams(temperature=0, max_tokens=32)


def chat(tokenizer, content: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
        )
    )


def shared_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


EXACT = ModelConfig(quantization="none", dtype="float32")


def test_shared_prefix_is_served_from_cache_with_identical_output(smollm, tokenizer):
    context = "\n\n".join(TEXT[:3])
    first = chat(tokenizer, f"{context}\n\nWho built the first lighthouse?")
    second = chat(tokenizer, f"{context}\n\nWhy did coal fires fail in fog?")
    shared = shared_length(first, second)
    assert shared >= 200

    # The fp32 reference: from a cached prefix the rest of the prompt attends through
    # another kernel path than a whole prompt does; in bf16 (the default with native bf16)
    # that can flip a near tie (README, "Determinism", measures how often).
    cached = LLMEngine(EngineConfig(EXACT, CacheConfig(256 << 20), debug_checks=True), smollm)
    cached.add_request("first", first, PARAMS)
    assert run(cached)["first"].cached_tokens == 0
    cached.add_request("second", second, PARAMS)
    got = run(cached)["second"]
    assert got.cached_tokens >= (shared // 16) * 16

    plain = LLMEngine(
        EngineConfig(EXACT, CacheConfig(256 << 20, enable_prefix_caching=False)), smollm
    )
    plain.add_request("second", second, PARAMS)
    expected = run(plain)["second"]
    assert expected.cached_tokens == 0
    assert got.token_ids == expected.token_ids and got.text == expected.text
