"""The model's linear layers, one at a time, in each weight format: int4 (bf16 and fp32
activations) against the oneDNN-packed fp32 and bf16 linears and plain fp32 F.linear.

    python bench/int4_kernels.py                 # this CPU, as it is
    python bench/int4_kernels.py --as-avx2       # the same, with PyTorch's and oneDNN's
                                                 # kernels held to AVX2 (a CPU without AVX-512)

Shapes are SmolLM2-135M's (qkv, o_proj, gate_up, down, LM head). Each layer gets --copies
distinct weights, cycled through, so that weights come from memory as in a real decode
step rather than from cache; a figure is microseconds a call (see `call_us`). `step_ms`
adds up a decode step's matmuls: 30 layers and the LM head.

--as-avx2 sets ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 for a child process:
the kernels an AVX2-only CPU would run, on this CPU's memory and caches. oneDNN's bf16
on such a CPU has no native instructions (PyTorch reports it unsupported and Parley leaves
bf16 linears unpacked); the child measures bf16 linears plain, as Parley would run them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.model.packed_linear import pack_weight, packing_available
from app.model.quant.int4 import Int4Linear, quantize_rtn

SHAPES = {  # name: (out_features, in_features, calls per decode step)
    "qkv": (960, 576, 30),
    "o_proj": (576, 576, 30),
    "gate_up": (3072, 576, 30),
    "down": (576, 1536, 30),
    "lm_head": (49152, 576, 1),
}
FORMATS = ("int4_bf16", "int4_fp32", "packed_fp32", "packed_bf16", "plain_fp32", "plain_bf16")


def layers(fmt: str, n: int, k: int, copies: int, avx2: bool) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, generator=g) / k**0.5
        if fmt.startswith("int4"):
            dtype = torch.bfloat16 if fmt == "int4_bf16" else torch.float32
            out.append(Int4Linear(quantize_rtn(w), None, dtype))
        elif fmt.startswith("packed"):
            dtype = torch.bfloat16 if fmt == "packed_bf16" else torch.float32
            if not packing_available() or (avx2 and dtype == torch.bfloat16):
                return []
            out.append(pack_weight(w.to(dtype)))
        else:
            dtype = torch.bfloat16 if fmt == "plain_bf16" else torch.float32
            out.append(partial(F.linear, weight=w.to(dtype)))
    return out


def call_us(fns: list, x: torch.Tensor, repeats: int) -> float:
    """Microseconds a call: each copy's fastest of `repeats` calls (one a pass through all
    copies, so its weight has left the cache in between), averaged over the copies. The
    fastest, not a median: on a shared machine a thread of the pool is now and then
    descheduled and the other waits for it (~8 ms here); with a busy neighbour that spoils
    most calls, and only the unspoilt ones measure the kernel."""
    for fn in fns[:2]:
        fn(x)
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn(x)
            best[i] = min(best[i], time.perf_counter() - start)
    return statistics.fmean(best) * 1e6


@torch.inference_mode()
def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    result: dict = {"capability": torch.backends.cpu.get_cpu_capability(), "us": {}}
    for rows in args.rows:
        per_format: dict[str, dict[str, float]] = {}
        for fmt in FORMATS:
            if fmt == "int4_fp32" and rows > args.fp32_int4_max_rows:
                continue  # a scalar loop: minutes at many rows, and never the choice
            step = 0.0
            per_layer = {}
            for name, (n, k, calls) in SHAPES.items():
                copies = 2 if name == "lm_head" else args.copies
                fns = layers(fmt, n, k, copies, args.as_avx2_child)
                if not fns:
                    break
                dtype = torch.bfloat16 if fmt.endswith("bf16") else torch.float32
                x = torch.randn(rows, k).to(dtype)
                us = call_us(fns, x, args.repeats)
                per_layer[name] = round(us, 1)
                step += us * calls
            else:
                per_layer["step_ms"] = round(step / 1000, 2)
                per_format[fmt] = per_layer
                print(rows, fmt, json.dumps(per_layer), flush=True)
        result["us"][rows] = per_format
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp32-int4-max-rows", type=int, default=1)
    ap.add_argument("--as-avx2", action="store_true", help="run in a child held to AVX2")
    ap.add_argument("--as-avx2-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if args.as_avx2:
        env = dict(
            os.environ,
            ATEN_CPU_CAPABILITY="avx2",
            ONEDNN_MAX_CPU_ISA="AVX2",
            MKL_ENABLE_INSTRUCTIONS="AVX2",
        )
        argv = [a for a in sys.argv[1:] if a != "--as-avx2"] + ["--as-avx2-child"]
        sys.exit(subprocess.run([sys.executable, __file__, *argv], env=env).returncode)
    result = measure(args)
    result["as_avx2"] = args.as_avx2_child
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
