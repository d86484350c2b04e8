"""Where one request's decode step goes: weight matmuls against everything else.

    python bench/decode_step.py [--context 40] [--steps 60] [--quantization auto --dtype auto]
                                [--cpu-kernels auto|on|off]

One request decodes greedily in the engine, alone. The median step time is measured
without a profiler; then torch.profiler attributes the weight matmuls' time (the int4
kernel, oneDNN's packed linears, int8 or plain GEMMs) per step. Everything else (attention
and its K/V gather, norms, rotary, sampling, Python) is the difference: issue 12 asks for
it to be <= 4 ms.

Then the memory bound: the bytes a decode step must read (every weight once, LM head
included, and the context's K/V), the machine's read bandwidth measured here with the
same threads (a sum over a buffer far larger than the caches), and the tok/s they allow:
the step's speed as a fraction of it.

    python bench/decode_step.py --model bench/results/random-1b.Q4_1.gguf  # the 1B shape
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.llm import LLM

MATMULS = (
    "parley::q4_matmul",
    "parley::block_matmul",
    "parley::group_matmul",
    "parley::q8_matmul",  # a Q8_0 LM head with 8-bit activations (AVX-512 VNNI)
    "parley::decode_layers",  # a whole int4 decode step's layers: mostly its matmuls
    "parley::decode_layers_normed",  # the same for Qwen3 and Gemma 3 (families)
    "aten::_weight_int4pack_mm_for_cpu",
    "mkldnn::_linear_pointwise",
    "quantized::linear_dynamic",
    "aten::mm",
    "aten::addmm",
    "aten::linear",
    "fbgemm",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=40, help="prompt tokens before decoding")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-kernels", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    args = ap.parse_args()
    model = ModelConfig(
        model=args.model, quantization=args.quantization, dtype=args.dtype,
        cpu_kernels=args.cpu_kernels,
    )  # fmt: skip
    # --threads pins the count the engine steps with (else app.engine.threads chooses it)
    config = EngineConfig(model=model, cache=CacheConfig(512 << 20), num_threads=args.threads)
    llm = LLM(config=config)
    engine = llm.engine
    words = " ".join(["lighthouse"] * max(args.context - 20, 1))
    ids = llm.chat_prompt([{"role": "user", "content": f"Tell me a story. {words}"}])
    params = SamplingParams(temperature=0, max_tokens=3 * args.steps + 40, ignore_eos=True)
    engine.add_request(EngineRequest(ids, params))
    while engine.step() == [] or engine.scheduler.running[0].num_output_tokens < 10:
        pass  # the prompt, then a few decodes to warm up
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    matmul_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith(MATMULS))
    matmul = matmul_us / 1e6 / args.steps
    ops = "Parley's CPU kernels" if engine.model.ops.fused else "PyTorch's ops"
    print(
        f"{engine.weight_format}; {ops}; context {len(ids)} tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"  decode step      {step * 1000:6.2f} ms (median of {args.steps}, {1 / step:.0f} tok/s)"
    )
    print(f"  weight matmuls   {matmul * 1000:6.2f} ms (profiled)")
    print(f"  everything else  {(step - matmul) * 1000:6.2f} ms (target <= 4 ms)")
    kv_row = engine.kv_cache.bytes_per_block // engine.kv_cache.block_size  # all layers' K, V
    step_bytes = engine.model_bytes + len(ids) * kv_row
    bandwidth = read_bandwidth()
    bound = bandwidth / step_bytes
    print(
        f"  bytes a step     {step_bytes / 1e6:6.1f} MB (weights {engine.model_bytes / 1e6:.1f} MB)"
    )
    print(f"  read bandwidth   {bandwidth / 1e9:6.1f} GB/s ({torch.get_num_threads()} threads)")
    print(f"  memory bound     {bound:6.1f} tok/s; this step reaches {1 / step / bound:.2f}x of it")


def read_bandwidth(size: int = 512 << 20, repeats: int = 8) -> float:
    """Bytes a second that summing a buffer far larger than the caches reads."""
    buf = torch.ones(size // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return size / best


if __name__ == "__main__":
    main()
