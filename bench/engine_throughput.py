"""Engine throughput: Parley in several weight formats (fp32, bf16, int4, int8) against
transformers' generate, side by side in one process.

    python bench/engine_throughput.py            # everything (~20 minutes on 2 cores)
    python bench/engine_throughput.py --quick    # fewer tokens, for a smoke run
    python bench/engine_throughput.py --quick --skip-hf --formats fp32,bf16,int4

This machine is shared and noisy: every figure that has a target is a ratio against a
baseline measured in the same run (transformers, or Parley's fp32 for the other formats),
each side taking the best of --repeats runs, and the runs of the sides alternate. Writes
a JSON file with every number (--out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import CacheConfig, EngineConfig, ModelConfig, parse_size
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.model.loader import load_model

TOPICS = [
    "volcanoes", "the moon", "honeybees", "the printing press", "jazz", "glaciers", "owls",
    "the Roman Empire", "photosynthesis", "chess", "lighthouses", "coffee", "octopuses",
    "the Silk Road", "rainbows", "bicycles", "the Pacific Ocean", "penguins", "tea",
    "the Eiffel Tower", "deserts", "the violin", "comets", "origami", "coral reefs",
    "the telescope", "maple trees", "sailing", "the alphabet", "thunderstorms", "bread",
    "the compass", "whales", "castles", "the piano", "mushrooms", "hot air balloons",
    "bamboo", "the pyramids", "snowflakes", "trains", "the human heart", "kites",
    "rivers", "dolphins", "windmills", "the calendar", "spiders", "clocks", "salt",
    "the Amazon rainforest", "elephants", "paper", "the Arctic", "bees and flowers",
    "satellites", "cheese", "the Great Wall", "frogs", "pottery", "earthquakes",
    "libraries", "wolves", "the wheel",
]  # fmt: skip
LONG_TEXT = (
    "The history of timekeeping is a history of people trying to agree on when things "
    "happen. Sundials, water clocks, candles marked with hours and mechanical escapements "
    "each served a community for a while, until trade, travel or science demanded more "
    "precision than they could give. "
)


def chat_ids(tokenizer, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
    )
    return list(ids)


def short_prompts(tokenizer, n: int) -> list[list[int]]:
    """~40-token chat prompts, all different."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        out.append(chat_ids(tokenizer, f"Tell me three surprising facts about {topic}, please."))
    return out


def long_prompt(tokenizer, tokens: int, salt: str) -> list[int]:
    ids = tokenizer.encode(f"[{salt}] " + LONG_TEXT * (tokens // 40 + 2), add_special_tokens=False)
    return ids[:tokens]


# -- Parley ----------------------------------------------------------------------------


def parley_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once; output tok/s over the whole run (prefill included)."""
    engine.kv.pool.reset_prefix_cache()  # every run computes its prompts
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(p, params, f"b{i}"))
    tokens = 0
    first_tokens, finishes = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                first_tokens.append(out.timings.first_token)
                finishes.append(out.timings.finished)
    elapsed = time.perf_counter() - start
    decode_s = max(finishes) - min(first_tokens)
    decode_rate = (tokens - len(prompts)) / decode_s if decode_s > 0 else 0.0
    return {"tok_s": tokens / elapsed, "seconds": elapsed, "decode_tok_s": decode_rate}


def parley_ttft(engine: LLMEngine, prompt: list[int]) -> float:
    engine.kv.pool.reset_prefix_cache()
    engine.add_request(EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=1), "ttft"))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def parley_itl_under_long_prefill(
    engine: LLMEngine, prompts: list[list[int]], long: list[int]
) -> dict:
    """8 requests decode; a long prompt arrives. Gaps between each decoder's tokens."""
    engine.kv.pool.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(p, params, f"d{i}"))
    arrivals: dict[str, list[float]] = {f"d{i}": [] for i in range(len(prompts))}
    long_added = long_first = None
    step = 0
    while engine.has_unfinished_requests():
        if step == 20:
            engine.add_request(
                EngineRequest(long, SamplingParams(temperature=0, max_tokens=1), "long")
            )
            long_added = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == "long":
                long_first = now
            elif out.new_token_ids:
                arrivals[out.request_id].append(now)
        step += 1
    gaps = [b - a for ts in arrivals.values() for a, b in itertools.pairwise(ts)]
    median = statistics.median(gaps)
    return {
        "median_gap_ms": median * 1000,
        "max_gap_ms": max(gaps) * 1000,
        "max_over_median": max(gaps) / median,
        "long_prompt_tokens": len(long),
        "long_ttft_s": (long_first - long_added) if long_first and long_added else None,
    }


# -- transformers ------------------------------------------------------------------------


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@torch.inference_mode()
def hf_batch(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> dict:
    """Left-padded batch through generate(); every sequence makes max_tokens tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    return {"tok_s": tokens / elapsed, "seconds": elapsed}


@torch.inference_mode()
def hf_forward(model, prompt: list[int]) -> float:
    start = time.perf_counter()
    model(torch.tensor([prompt]))
    return time.perf_counter() - start


# -- the run -----------------------------------------------------------------------------


def alternate(engines: dict, fn, repeats: int) -> dict[str, list]:
    """`fn(engine)` `repeats` times for each engine, taking turns, so that a noisy spell of
    the machine falls on every format alike."""
    runs: dict[str, list] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            runs[name].append(fn(engine))
    return runs


def best(fn, repeats: int, key: str = "tok_s", lower: bool = False):
    runs = [fn() for _ in range(repeats)]
    if isinstance(runs[0], float):
        return min(runs) if lower else max(runs)
    return (min if lower else max)(runs, key=lambda r: r[key])


# The formats a run can compare: --formats picks among them; fp32 is the baseline.
FORMATS = {
    "fp32": ("none", "float32"),
    "bf16": ("none", "bfloat16"),
    "int4": ("int4", "bfloat16"),
    "int4-fp32": ("int4", "float32"),  # fp32 activations around bf16 int4 matmuls
    "int8": ("int8", "float32"),
    "default": ("auto", "auto"),
}


def peak_rss_child(kv_bytes: int, max_tokens: int, fmt: str = "fp32") -> dict:
    """Peak RSS of a fresh process that loads the model with a `kv_bytes` cache and
    serves 64 requests (so that the cache is really written). Read from VmHWM: a child's
    ru_maxrss starts from its parent's peak (Linux carries it across fork and exec)."""
    code = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
import torch
torch.set_num_threads(2)
from bench.engine_throughput import short_prompts, parley_batch
from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.engine import LLMEngine
q, d = {FORMATS[fmt]!r}
e = LLMEngine(EngineConfig(model=ModelConfig(quantization=q, dtype=d),
                           cache=CacheConfig(kv_cache_bytes={kv_bytes})))
weights = e.model_bytes
parley_batch(e, short_prompts(e.tokenizer, 64), {max_tokens})
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({{"peak_rss_mib": int(hwm.split()[1]) / 1024,
                  "weights_mib": weights / 2**20, "kv_mib": e.kv_cache.nbytes / 2**20,
                  "kv_used_blocks_peak_note": "64 x (40 + {max_tokens}) tokens written"}}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": result.stderr[-2000:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 tokens instead of 128")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--formats",
        default="fp32,int8",
        help=f"comma-separated, fp32 first (the baseline): {', '.join(FORMATS)}",
    )
    ap.add_argument("--kv-cache-size", type=parse_size, default="2GiB", help="per engine")
    ap.add_argument("--skip-tables", action="store_true", help="no concurrency table, no ITL")
    ap.add_argument("--out", default="bench/results/engine_throughput.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_tokens = 32 if args.quick else 128
    formats = args.formats.split(",")
    if formats[0] != "fp32" or any(f not in FORMATS for f in formats):
        ap.error(f"--formats: fp32 first, then any of {', '.join(FORMATS)}")
    results: dict = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "capability": torch.backends.cpu.get_cpu_capability(),
        },
        "max_tokens": max_tokens,
        "formats": formats,
    }

    loaded = load_model(ModelConfig())
    engines = {}
    for fmt in formats:
        q, d = FORMATS[fmt]
        config = EngineConfig(
            model=ModelConfig(quantization=q, dtype=d),
            cache=CacheConfig(kv_cache_bytes=args.kv_cache_size),
        )
        engines[fmt] = LLMEngine(config, loaded)
        results.setdefault("weights", {})[fmt] = engines[fmt].weight_format
    engine = engines["fp32"]
    tok = engine.tokenizer
    hf = None if args.skip_hf else hf_model(Path(_default_path()))
    pad = tok.eos_token_id

    def compare(name: str, n: int) -> None:
        prompts = short_prompts(tok, n)
        row: dict = {"requests": n, "prompt_tokens": len(prompts[0])}
        runs = alternate(engines, lambda e: parley_batch(e, prompts, max_tokens), args.repeats)
        for fmt, rs in runs.items():
            label = "parley" if fmt == "fp32" else f"parley_{fmt}"
            row[label] = max(rs, key=lambda r: r["tok_s"])
            if fmt != "fp32":
                row[f"{fmt}_vs_fp32"] = row[label]["tok_s"] / row["parley"]["tok_s"]
                if n == 1:
                    row[f"{fmt}_vs_fp32_decode"] = (
                        row[label]["decode_tok_s"] / row["parley"]["decode_tok_s"]
                    )
        if hf is not None:
            base = best(lambda: hf_batch(hf, prompts, max_tokens, pad), args.repeats)
            row["hf"] = base
            row["ratio"] = row["parley"]["tok_s"] / base["tok_s"]
            if n == 1:
                row["parley_decode_vs_hf"] = row["parley"]["decode_tok_s"] / base["tok_s"]
        results[name] = row
        print(name, json.dumps(row), flush=True)

    compare("batch_1", 1)
    compare("batch_8", 8)
    compare("batch_32", 32)

    long = long_prompt(tok, 1500, "ttft")
    ttft: dict = {"prompt_tokens": len(long)}
    for fmt, rs in alternate(engines, lambda e: parley_ttft(e, long), args.repeats).items():
        label = "parley_s" if fmt == "fp32" else f"parley_{fmt}_s"
        ttft[label] = min(rs)
        if fmt != "fp32":
            ttft[f"{fmt}_vs_fp32"] = ttft[label] / ttft["parley_s"]
    if hf is not None:
        ttft["hf_forward_s"] = best(lambda: hf_forward(hf, long), args.repeats, lower=True)
        ttft["ratio"] = ttft["parley_s"] / ttft["hf_forward_s"]
    results["ttft_1500"] = ttft
    print("ttft_1500", json.dumps(ttft), flush=True)

    if not args.skip_tables:
        for fmt, e in engines.items():
            table = {}
            for n in (1, 4, 8, 16, 32, 64):
                r = parley_batch(e, short_prompts(tok, n), max_tokens)
                table[n] = round(r["tok_s"], 1)
                print(f"concurrency {n}, {fmt}: {r['tok_s']:.1f} tok/s", flush=True)
            results[f"concurrency_{'' if fmt == 'fp32' else fmt + '_'}tok_s"] = table
        long_2k = long_prompt(tok, 2000, "l")
        itl = parley_itl_under_long_prefill(engine, short_prompts(tok, 8), long_2k)
        results["itl_under_long_prefill"] = itl
        print("itl_under_long_prefill", json.dumps(itl), flush=True)

    engines.clear()  # the children measure memory on their own
    del engine
    for fmt in formats:
        key = "rss" if fmt == "fp32" else f"rss_{fmt}"
        results[key] = rss = peak_rss_child(args.kv_cache_size, max_tokens, fmt)
        if fmt != "fp32" and "peak_rss_mib" in rss and "peak_rss_mib" in results["rss"]:
            rss["saved_vs_fp32_mib"] = results["rss"]["peak_rss_mib"] - rss["peak_rss_mib"]
        print(key, json.dumps(rss), flush=True)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


def _default_path() -> str:
    from app.config import default_cache_dir
    from app.model.registry import default_model_path

    return str(default_model_path(default_cache_dir()))


if __name__ == "__main__":
    main()
