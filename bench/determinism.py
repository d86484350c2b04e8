"""How often a reply changes with the path that computed its prompt, per weight format.

The same chat prompt is run twice in one engine: the first time it is computed whole, the
second time from its cached prefix (the prefix cache holds its full blocks). Greedy replies
and seeded sampled ones are compared. In fp32 both paths agree to the last bit that decides
a token; with bf16 activations or int4 weights (whose matmuls take bf16 inputs) a tiny
difference upstream can flip a rounding and, at a near tie, the token.

A second table takes greedy replies cut at a few points and continued the two ways a
resumed turn can be (app.server.turn_runner): from one prefill of the prompt plus the
tokens before the cut, or replaying those tokens one decode step each
(EngineRequest.replay_ids); it counts continuations that differ from the whole reply.

    python bench/determinism.py [--formats none:float32,int4:float32,auto:auto] [--seeds 8]
"""

from __future__ import annotations

import argparse

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.llm import LLM

PROMPTS = [
    "Invent a name.",
    "Tell me a story about a lighthouse.",
    "What is 0?",
    "Write a haiku about rain.",
    "List three fruits.",
    "Explain what a CPU cache is.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
]


def differing(llm: LLM, params: SamplingParams, ids: list[int]) -> bool:
    whole = llm.generate([ids], params)[0].token_ids  # the prompt computed whole
    cached = llm.generate([ids], params)[0].token_ids  # from its cached prefix
    return whole != cached


CUTS = (5, 17, 30, 45)


def resumed(llm: LLM, ids: list[int], max_tokens: int = 64) -> tuple[int, int]:
    """Continuations of a greedy reply, cut at CUTS, that differ from it: (from one
    prefill, replayed)."""
    whole = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens,
                                               ignore_eos=True))[0].token_ids  # fmt: skip
    prefilled = replayed = 0
    for cut in CUTS:
        llm.engine.kv.pool.reset_prefix_cache()  # as after a restart
        rest = SamplingParams(temperature=0, max_tokens=max_tokens - cut, ignore_eos=True)
        prefilled += llm.generate([ids + whole[:cut]], rest)[0].token_ids != whole[cut:]
        llm.engine.kv.pool.reset_prefix_cache()
        greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        replayed += replay(llm, EngineRequest(ids, greedy, replay_ids=whole[:cut])) != whole[cut:]
    return prefilled, replayed


def replay(llm: LLM, asked: EngineRequest) -> list[int]:
    """The output ids of one request through the engine (LLM.generate takes no replay)."""
    llm.engine.add_request(asked)
    out: list[int] = []
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            out += o.new_token_ids
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="none:float32,int4:float32,auto:auto")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    print("| format | seeded sampled replies that differ | greedy replies that differ |")
    print("| --- | --- | --- |")
    continued = []
    for spec in args.formats.split(","):
        quantization, dtype = spec.split(":")
        model = ModelConfig(quantization=quantization, dtype=dtype)
        # The prefix cache is emptied before each pair: the "whole" run computes it all.
        seeded = greedy = 0
        llm = LLM(config=EngineConfig(model=model, cache=CacheConfig(256 << 20)))
        for text in PROMPTS:
            ids = llm.chat_prompt([{"role": "user", "content": text}])
            llm.engine.kv.pool.reset_prefix_cache()
            for seed in range(args.seeds):
                sampled = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=seed)
                seeded += differing(llm, sampled, ids)
                llm.engine.kv.pool.reset_prefix_cache()
            greedy += differing(llm, SamplingParams(temperature=0, max_tokens=64), ids)
        fmt = llm.engine.weight_format
        n = len(PROMPTS)
        print(f"| {fmt} | {seeded} of {n * args.seeds} | {greedy} of {n} |", flush=True)
        counts = [resumed(llm, llm.chat_prompt([{"role": "user", "content": t}])) for t in PROMPTS]
        continued.append((fmt, *map(sum, zip(*counts, strict=True))))
    n = len(PROMPTS) * len(CUTS)
    print(f"\nGreedy replies cut after {', '.join(map(str, CUTS))} tokens and continued:\n")
    print("| format | from one prefill: differ | replayed: differ |")
    print("| --- | --- | --- |")
    for fmt, prefilled, replayed in continued:
        print(f"| {fmt} | {prefilled} of {n} | {replayed} of {n} |")


if __name__ == "__main__":
    main()
