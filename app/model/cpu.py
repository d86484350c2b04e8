"""What this CPU runs fast: the facts the weight formats and their defaults are chosen by.

Read from /proc/cpuinfo's flags, within the vector width PyTorch dispatches to
(`ATEN_CPU_CAPABILITY=avx2` holds an AVX-512 machine to AVX2, which is how the benchmarks
measure an AVX2-only CPU here). Tests fake a capability by monkeypatching these functions.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


@cache
def cpu_flags() -> frozenset[str]:
    """The kernel's feature flags of the first CPU (empty where /proc is not Linux's)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def cpu_has_bf16() -> bool:
    """Native bf16 arithmetic (AVX-512 BF16, or AMX): bf16 activations and oneDNN's bf16
    kernels run at full speed. Elsewhere bf16 is emulated and slower than fp32."""
    flags = cpu_flags()
    return cpu_has_avx512() and ("avx512_bf16" in flags or "amx_bf16" in flags)


def cpu_has_vnni() -> bool:
    """AVX-512 VNNI / AVX-VNNI multiply 8-bit activations without the 16-bit saturation of
    older x86 paths (fbgemm's int8 needs 7-bit activations without it)."""
    flags = cpu_flags()
    return "avx512_vnni" in flags or "avx_vnni" in flags


def describe_cpu() -> str:
    """A few words for the start-up log."""
    caps = [torch.backends.cpu.get_cpu_capability()]
    caps += [f for f in ("avx512_bf16", "amx_bf16", "avx512_vnni") if f in cpu_flags()]
    return " ".join(caps)
