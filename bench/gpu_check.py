"""Checks of the engine on a CUDA GPU, without the server: logits against transformers
and throughput against transformers' generate, same GPU, same run.

    python bench/gpu_check.py tokenizer OUT_DIR     # here: save the default model's tokenizer
    python bench/gpu_check.py logits --tokenizer DIR            # on the GPU
    python bench/gpu_check.py throughput --tokenizer DIR [--shape 1b]

The GPU machine has no network: the model is random weights in a real model's shape
(SmolLM2-135M, or Llama-3.2-1B's with --shape 1b), written as a Hugging Face folder with
the tokenizer and loaded by both sides. Throughput does not depend on the weights' values
(every request runs to max_tokens); the logits check compares implementations, not
models. Prints one JSON line per result; bench/gpu_check.sh runs it all.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams

SHAPES = {  # hidden, intermediate, layers, heads, kv heads (head_dim = hidden / heads)
    "135m": (576, 1536, 30, 9, 3),
    "1b": (2048, 8192, 16, 32, 8),
}
HBM_BYTES_S = 4.8e12  # H200


def random_folder(tokenizer_dir: str, shape: str, out: Path, std: float) -> Path:
    """A random LlamaForCausalLM in `shape`, saved with the tokenizer."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    hidden, inter, layers, heads, kv = SHAPES[shape]
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        initializer_range=std,  # larger than training's 0.02: well-spread logits, few ties
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def engine(folder: Path, max_num_seqs: int, kv_bytes: int, graphs: bool = True) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(folder)),  # auto on CUDA: bf16, weights as loaded
            cache=CacheConfig(kv_cache_bytes=kv_bytes),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
            device="cuda",
            cuda_graphs=graphs,
        )
    )


def hf_model(folder: Path, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()


def prompts(tokenizer, n: int, length: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(100, len(tokenizer) - 100, (n, length), generator=g).tolist()


def cmd_logits(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_folder(args.tokenizer, args.shape, Path(tmp), std=0.05)
        hf = hf_model(folder)
        hf32 = hf_model(folder, torch.float32)  # what bf16 rounding alone costs, either side
        eng = engine(folder, 16, parse_size("2GiB"))
        worst, worst32, hf_worst32, agree, total, short = 0.0, 0.0, 0.0, 0, 0, 0

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return ((a - b).abs().max() / b.abs().max()).item()

        for ids in prompts(eng.tokenizer, 8, 200):
            with torch.inference_mode():
                ours = eng.model.forward_tokens(ids).float()
                ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
                ref32 = hf32(torch.tensor([ids], device="cuda")).logits[0].float()
            worst = max(worst, rel(ours, ref))
            worst32, hf_worst32 = max(worst32, rel(ours, ref32)), max(hf_worst32, rel(ref, ref32))
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        ps = prompts(eng.tokenizer, 8)
        for i, p in enumerate(ps):
            eng.add_request(EngineRequest(p, params, f"g{i}"))
        got: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():  # deltas
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        for i, p in enumerate(ps):
            with torch.inference_mode():
                ref_ids = hf.generate(
                    torch.tensor([p], device="cuda"),
                    max_new_tokens=64, min_new_tokens=64, do_sample=False,
                )[0, len(p) :].tolist()  # fmt: skip
            ours_ids = got.get(f"g{i}", [])  # a failed request: fewer than 64, counted so
            same = next((j for j, (a, b) in enumerate(zip(ours_ids, ref_ids)) if a != b), None)
            same = min(len(ours_ids), len(ref_ids)) if same is None else same
            short += len(ours_ids) < 64
            agree += same
            total += 64
        print(json.dumps({
            "check": "logits_vs_transformers", "gpu": torch.cuda.get_device_name(),
            "shape": args.shape, "dtype": "bfloat16",
            "max_abs_err_rel_to_max_logit": round(worst, 5),
            "ours_vs_transformers_fp32": round(worst32, 5),
            "transformers_bf16_vs_fp32": round(hf_worst32, 5),
            "greedy_tokens_before_first_divergence": f"{agree}/{total}",
            "requests_short_of_64_tokens": short,
            "pass": worst < 0.05 and short == 0,
        }))  # fmt: skip


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def parley_tok_s(eng: LLMEngine, ps: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def go() -> None:
        for i, p in enumerate(ps):
            eng.add_request(EngineRequest(p, params, f"t{time.monotonic_ns()}-{i}"))
        while eng.has_unfinished_requests():
            eng.step()

    go()  # warm-up: compiles FlexAttention, captures the graphs
    return len(ps) * max_tokens / timed(go)


def hf_tok_s(model, ps: list[list[int]], max_tokens: int) -> float:
    ids = torch.tensor(ps, device="cuda")  # equal lengths: a static batch without padding

    def go() -> None:
        with torch.inference_mode():
            model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )

    go()
    return len(ps) * max_tokens / timed(go)


def cmd_throughput(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_folder(args.tokenizer, args.shape, Path(tmp), std=0.02)
        hf = hf_model(folder)
        eng = engine(folder, 256, parse_size(args.kv_cache_size), graphs=not args.no_graphs)
        tok = eng.tokenizer
        one = prompts(tok, 1)
        many = prompts(tok, 256)
        n = args.max_tokens
        p1, h1 = parley_tok_s(eng, one, n), hf_tok_s(hf, one, n)
        print(f"one request: parley {p1:.1f} tok/s, hf {h1:.1f} tok/s", file=sys.stderr)
        p256, h256 = parley_tok_s(eng, many, n), hf_tok_s(hf, many, n)
        # One request's decode step reads every weight once and its own K/V (mean context).
        kv_per_token = 2 * eng.arch.num_layers * eng.arch.kv_size * 2  # bf16
        step_bytes = eng.model_bytes + kv_per_token * (len(one[0]) + n / 2)
        print(json.dumps({
            "check": "throughput_vs_hf_generate", "gpu": torch.cuda.get_device_name(),
            "shape": args.shape, "max_tokens": n, "cuda_graphs": not args.no_graphs,
            "one_request_tok_s": {"parley": round(p1, 1), "hf": round(h1, 1),
                                  "ratio": round(p1 / h1, 2), "target": 3.0},
            "256_requests_tok_s": {"parley": round(p256, 1), "hf": round(h256, 1),
                                   "ratio": round(p256 / h256, 2), "target": 5.0},
            "one_request_bandwidth_fraction": round(step_bytes * p1 / HBM_BYTES_S, 3),
        }))  # fmt: skip


def cmd_tokenizer(args) -> None:
    from app.model.loader import load_model

    load_model(ModelConfig()).tokenizer.save_pretrained(args.out)
    print(f"tokenizer saved in {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer", help="save the default model's tokenizer (run it here)")
    t.add_argument("out")
    for name in ("logits", "throughput"):
        s = sub.add_parser(name)
        s.add_argument("--tokenizer", required=True, help="a tokenizer folder")
        s.add_argument("--shape", choices=sorted(SHAPES), default="135m")
        if name == "throughput":
            s.add_argument("--max-tokens", type=int, default=256)
            s.add_argument("--kv-cache-size", default="16GiB")
            s.add_argument("--no-graphs", action="store_true")
    args = ap.parse_args()
    {"tokenizer": cmd_tokenizer, "logits": cmd_logits, "throughput": cmd_throughput}[args.cmd](args)


if __name__ == "__main__":
    main()
