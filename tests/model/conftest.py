"""Kernel builds the tests share: each compile of Parley's CPU kernels takes ~30 s on 2
cores, so a build made for one test serves the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.model import cpu, kernels
from tests.model.kernel_builds import load_in_process


@pytest.fixture(scope="session")
def avx2_build(tmp_path_factory) -> tuple[Path, str, str, str]:
    """The kernels built for an AVX2-only CPU (x86-64-v3) in a cache of the session's own:
    (cache, march, key, the build's log)."""
    if "avx2" not in cpu.cpu_flags() or not kernels.shutil.which("g++"):
        pytest.skip("needs g++ on an x86 CPU with AVX2")
    cache = tmp_path_factory.mktemp("kernel-cache")
    key, log = load_in_process(cache, "x86-64-v3")
    return cache, "x86-64-v3", key, log
