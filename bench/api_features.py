"""The API features' costs, each as a ratio measured in one run (issue 16):

1. n=8 against 8 separate requests for the same prompt: prompt tokens computed, peak KV
   blocks, time until all 8 replies are done;
2. a JSON-schema mask (fill + apply + advancing the matcher) per decode step, at 1 and 32
   concurrent constrained requests, against the rest of the step;
3. top_logprobs 5: the logprobs work per decode step against the rest of the step, at 1 and
   32 requests, and the end-to-end decode rate against the same requests without it.

    python bench/api_features.py            # ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import CacheConfig, EngineConfig, GiB, ModelConfig
from app.engine import model_runner, structured
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.request import ResponseFormat, SamplingParams
from app.model.loader import load_model
from bench.engine_throughput import chat_ids, long_prompt, short_prompts


class Clock:
    """Seconds spent in wrapped functions."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def drive(engine: LLMEngine) -> dict:
    """Step until idle: wall time, step time, prompt tokens computed, peak blocks."""
    pool = engine.kv.pool
    computed, peak, steps = 0, 0, 0
    schedule = engine.scheduler.schedule

    def counting():
        nonlocal computed
        out = schedule()
        computed += sum(s.num_tokens for s in out.scheduled if not s.is_decode)
        return out

    engine.scheduler.schedule = counting
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            peak = max(peak, pool.num_blocks - pool.num_free_blocks)
    finally:
        engine.scheduler.schedule = schedule
    return {"seconds": time.perf_counter() - start, "prompt_tokens_computed": computed,
            "peak_blocks": peak, "steps": steps}  # fmt: skip


def n_vs_separate(engine: LLMEngine, run: int) -> dict:
    prompt = long_prompt(engine.tokenizer, 500, f"n-{run}")  # a fresh prompt each run
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=32, ignore_eos=True)
    engine.add_request(
        EngineRequest(prompt, SamplingParams(**{**params.__dict__, "n": 8}), f"n8-{run}")
    )
    together = drive(engine)
    prompt = long_prompt(engine.tokenizer, 500, f"sep-{run}")
    for i in range(8):
        engine.add_request(EngineRequest(prompt, params, f"sep{i}-{run}"))
    apart = drive(engine)
    return {"n8": together, "separate8": apart,
            "ratio_time": together["seconds"] / apart["seconds"],
            "ratio_prompt_tokens": together["prompt_tokens_computed"]
            / apart["prompt_tokens_computed"],
            "ratio_blocks": together["peak_blocks"] / apart["peak_blocks"]}  # fmt: skip


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer"},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


def mask_cost(engine: LLMEngine, concurrency: int) -> dict:
    clock = Clock()
    originals = (model_runner.token_masks, structured.TokenMasks.apply,
                 structured.Grammar.accept, structured.Grammar.must_end)  # fmt: skip
    model_runner.token_masks = clock.wrap(originals[0])
    structured.TokenMasks.apply = clock.wrap(originals[1])
    structured.Grammar.accept = clock.wrap(originals[2])
    structured.Grammar.must_end = clock.wrap(originals[3])
    try:
        fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
        for i, p in enumerate(short_prompts(engine.tokenizer, concurrency)):
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=80, response_format=fmt)
            engine.add_request(EngineRequest(p, params, f"json{concurrency}-{i}"))
        r = drive(engine)
    finally:
        (model_runner.token_masks, structured.TokenMasks.apply,
         structured.Grammar.accept, structured.Grammar.must_end) = originals  # fmt: skip
    rest = r["seconds"] - clock.seconds
    return {"concurrency": concurrency, "steps": r["steps"], "mask_ms_per_step":
            clock.seconds / r["steps"] * 1000, "rest_ms_per_step": rest / r["steps"] * 1000,
            "mask_vs_step": clock.seconds / rest}  # fmt: skip


def logprobs_cost(engine: LLMEngine, concurrency: int, repeats: int) -> dict:
    prompts = short_prompts(engine.tokenizer, concurrency)
    clock = Clock()
    original = model_runner.token_logprobs
    model_runner.token_logprobs = clock.wrap(original)
    timings = {"off": [], "on": []}
    try:
        for _ in range(repeats):  # alternate, best of each
            for mode in ("off", "on"):
                before = clock.seconds
                for i, p in enumerate(prompts):
                    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                            logprobs=5 if mode == "on" else None)  # fmt: skip
                    engine.add_request(EngineRequest(p, params, f"lp-{mode}-{i}"))
                r = drive(engine)
                timings[mode].append((r["seconds"], clock.seconds - before, r["steps"]))
    finally:
        model_runner.token_logprobs = original
    off = min(t[0] for t in timings["off"])
    on_run = min(timings["on"])
    calls_when_off = sum(t[1] for t in timings["off"])
    return {"concurrency": concurrency, "off_s": off, "on_s": on_run[0],
            "end_to_end_ratio": on_run[0] / off,
            "logprobs_ms_per_step": on_run[1] / on_run[2] * 1000,
            "logprobs_vs_step": on_run[1] / (on_run[0] - on_run[1]),
            "logprobs_seconds_when_nobody_asks": calls_when_off}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/api_features.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=ModelConfig(), cache=CacheConfig(kv_cache_bytes=GiB)),
                       load_model(ModelConfig()))  # fmt: skip
    chat_ids(engine.tokenizer, "warm up")
    results: dict = {"machine": {"cores": torch.get_num_threads(), "torch": torch.__version__}}
    runs = [n_vs_separate(engine, r) for r in range(args.repeats)]
    results["n8_vs_8_separate"] = best = min(runs, key=lambda r: r["ratio_time"])
    print("n8_vs_8_separate", json.dumps(best), flush=True)
    for c in (1, 32):
        results[f"json_mask_{c}"] = r = mask_cost(engine, c)
        print(f"json_mask_{c}", json.dumps(r), flush=True)
    for c in (1, 32):
        results[f"top_logprobs5_{c}"] = r = logprobs_cost(engine, c, args.repeats)
        print(f"top_logprobs5_{c}", json.dumps(r), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
