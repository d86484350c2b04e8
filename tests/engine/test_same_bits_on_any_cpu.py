"""The default format's "same bits whatever the path" holds on every CPU by construction,
not by the luck of the machine.

A token's logprobs must not depend on whether it was decoded, scored in a prompt, chunked
or cached (resumable streams, journal replay and the kill -9 restart rest on it). Which
kernel oneDNN or ATen picks depends on the CPU: an Intel Xeon with AVX-512 FP16 broke the
property through oneDNN's bf16 LM head, whose result there depended on its row count.
Two things keep it now, each checked here:

- no oneDNN primitive runs while the default format serves (the LM head is Parley's
  block_matmul): whatever oneDNN would choose on a CPU, it is never asked;
- the ops that remain (ATen's int4 matmul and elementwise ops, Parley's kernels) compute a
  row on its own at every ISA level: the same-bits tests pass with ATen and oneDNN held to
  each ceiling this machine can run (an AVX2-only CPU, AVX-512 without BF16, ...).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.model import cpu

ROOT = Path(__file__).resolve().parents[2]
SAME_BITS = [
    "tests/engine/test_prefix_cache_real.py::"
    "test_default_format_a_token_has_the_same_bits_decoded_prompted_chunked_or_cached",
    "tests/model/test_q8_0.py::test_a_logit_has_the_same_bits_in_any_batch_on_any_thread_count",
]


def ceilings() -> list[tuple[str, dict[str, str]]]:
    """ISA ceilings this machine can run: (name, environment)."""
    flags = cpu.cpu_flags()
    out = []
    if "avx2" in flags:
        out.append(("AVX2-only CPU", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}))
    if "avx512f" in flags:
        out.append(("AVX-512 without BF16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}))
    if "avx512_bf16" in flags:
        out.append(("AVX-512 BF16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}))
    out.append(("everything this CPU has", {"ONEDNN_MAX_CPU_ISA": "ALL"}))
    return out


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEDNN_", "ATEN_CPU"))}
    return env | extra


@pytest.mark.parametrize("name,env", ceilings(), ids=[n for n, _ in ceilings()])
def test_the_same_bits_tests_pass_at_each_isa_ceiling(name, env, smollm):  # smollm: cached
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SAME_BITS],
        cwd=ROOT, env=child_env(env), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, f"{name}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert f"{len(SAME_BITS)} passed" in done.stdout


def test_no_onednn_primitive_runs_while_the_default_format_serves(smollm):
    """A prompt scored whole, a decode with logprobs: oneDNN's verbose log stays empty
    from the first step on, so no CPU's choice of oneDNN kernel can reach a token's bits."""
    script = textwrap.dedent(
        """
        import sys
        from app.config import CacheConfig, EngineConfig, ModelConfig
        from app.engine.engine import LLMEngine
        from app.engine.engine_request import EngineRequest
        from app.engine.request import SamplingParams

        engine = LLMEngine(EngineConfig(ModelConfig(), CacheConfig(64 << 20)))
        assert engine.model.ops.fused, "Parley's kernels did not load"
        print("SERVING", flush=True)
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, prompt_logprobs=1)
        for i, text in enumerate(("The lighthouse keeper", "Once upon a time, far away")):
            engine.add_request(EngineRequest(text, params, f"r{i}"))
        while engine.has_unfinished_requests():
            engine.step()
        print("DONE", flush=True)
        # The control: a oneDNN matmul does show in the log.
        import torch
        from app.model.packed_linear import pack_weight
        pack_weight(torch.randn(64, 64))(torch.randn(2, 64))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
        env=child_env({"ONEDNN_VERBOSE": "all"}), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "SERVING" in log and "DONE" in log
    serving = log[log.index("SERVING") : log.index("DONE")]
    calls = [line for line in serving.splitlines() if line.startswith("onednn_verbose")]
    assert calls == [], calls[:5]
    assert "primitive,exec" in log[log.index("DONE") :], "oneDNN's verbose log is silent"
