"""Parley's CPU kernels (cpu_kernels.cpp: the layers' small ops and attention; matmul.cpp:
a float LM head's matmul; qmatmul.cpp: the quantized linears' and heads' matmuls, q4_matmul
and group_matmul), compiled once per machine and loaded as `torch.ops.parley.*`.

A decode step at one request is ~40 small tensor ops a layer, each a few microseconds of
dispatch for a few thousand multiply-adds; the kernels here do a layer's norms, rotary,
K/V write and decode attention in four calls, and a decode step's whole int4 layer stack
in one (app/model/llama.py's FusedCpuOps says which replaces what).

The source is compiled by torch.utils.cpp_extension (g++ and ninja) with `-march=native`,
so the machine's vector width is the compiler's to use: AVX-512 here, AVX2 on an older
CPU, from the same portable C++. The build is cached under the model cache, keyed by what
it depends on (`build_inputs`): the source, the torch install (its version, build and
folder, whose headers and libraries the build uses), Python's headers, the compiler (which
one, and its version), the target and this CPU's flags. A build environment compiles it once
(~10-20 s on 2 cores) and later starts load it in milliseconds; two virtual environments
on one machine keep a build each instead of rebuilding each other's. Where there is no compiler, or
the build fails, the model runs PyTorch's ops instead and the start-up log says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from app.model import cpu

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(n) for n in ("cpu_kernels.cpp", "matmul.cpp", "qmatmul.cpp")
)
# -ffp-contract=off: no fused multiply-adds the C++ does not spell out, so that products and
# sums round as PyTorch's separate ops round them.
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
_loaded: str | None = None  # the build key loaded into this process, if any


@functools.cache
def compiler_identity(cxx: str) -> str:
    """The C++ compiler torch's builder runs ($CXX, else c++): its path and version."""
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx}: not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        version = (out.stdout.strip().splitlines() or ["?"])[0]
    except (OSError, subprocess.SubprocessError):
        version = "?"
    return f"{os.path.realpath(path)} {version}"


def build_inputs(march: str = "native") -> dict[str, str]:
    """What a build depends on besides its source, by name."""
    return {
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "torch_dir": str(Path(torch.__file__).resolve().parent),
        "python": f"{sys.version_info[:2]} {sysconfig.get_paths()['include']}",
        "compiler": compiler_identity(os.environ.get("CXX", "c++")),
        "target": f"{march} {' '.join(CFLAGS)}",
        "cpu": " ".join(sorted(cpu.cpu_flags())),
    }


def build_key(code: bytes, march: str = "native") -> str:
    """The build's cache key: the source and everything in build_inputs."""
    h = hashlib.sha256(code)
    for name, value in sorted(build_inputs(march).items()):
        h.update(f"\0{name}={value}".encode())
    return h.hexdigest()[:16]


def sources_key(march: str = "native") -> str:
    """The build key of the kernels' sources as they are on disk."""
    return build_key(b"".join(src.read_bytes() for src in SOURCES), march)


def load(cache_dir: Path, march: str = "native") -> str | None:
    """Compile (once) and load the kernels; None when they are loaded, else why not.

    One process holds one build: `torch.ops.parley` is a single namespace. The build
    directory is locked while it compiles, so processes starting together build it once."""
    global _loaded
    codes = {src.name: src.read_bytes() for src in SOURCES}
    key = build_key(b"".join(codes.values()), march)
    if _loaded is not None:
        return None if _loaded == key else f"another build ({_loaded}) is loaded"
    from torch.utils import cpp_extension

    _ninja_on_path()
    build_dir = Path(cache_dir) / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build_dir / "lock")
    # The build compiles copies kept beside it: ninja rebuilds when a source's path changes,
    # and two checkouts of the same source would otherwise take turns recompiling it.
    sources = []
    for name, code in codes.items():
        source = build_dir / name
        if not source.exists() or source.read_bytes() != code:
            tmp = build_dir / f".{name}.{os.getpid()}"
            tmp.write_bytes(code)
            tmp.replace(source)
        sources.append(str(source))
    built = max((p.stat().st_mtime for p in build_dir.glob("*.so")), default=None)
    if built is None:
        log.info(
            "compiling Parley's CPU kernels for this CPU and build environment (once; "
            "~10-20 s on 2 cores)..."
        )
    start = time.perf_counter()
    try:
        cpp_extension.load(
            name=f"parley_kernels_{key}",
            sources=sources,
            extra_cflags=[*CFLAGS, f"-march={march}"],
            # The libgomp torch has loaded (same soname): one OpenMP pool, not two.
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return f"the kernels did not build ({reason[:200]})"
    _loaded = key
    if built != max((p.stat().st_mtime for p in build_dir.glob("*.so")), default=None):
        log.info(
            "compiled Parley's CPU kernels in %.1f s (once for this build environment; cached "
            "in %s)",
            time.perf_counter() - start,
            build_dir,
        )
    return None


# A build takes ~10 s; a lock older than this was left by a process killed mid-build, and
# torch's builder would wait for it forever.
STALE_LOCK_S = 600


def _clear_stale_lock(lock: Path) -> None:
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            log.warning("removed a stale build lock left by a killed process: %s", lock)
    except FileNotFoundError:
        pass


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the PyPI package's binary may not be on it
    (a virtual environment that is not activated)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
