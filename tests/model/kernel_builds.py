"""Loading Parley's CPU kernels in a process of their own (one build a process), for the
tests of their builds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

LOAD = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from app.model import kernels
    why = kernels.load(Path(sys.argv[1]), march=sys.argv[2])
    assert why is None, why
    print(kernels.sources_key(sys.argv[2]))
    """
)


def load_in_process(cache: Path, march: str, env: dict[str, str] | None = None):
    """Load the kernels built for `march` from `cache` (compiling them there once) in a
    process of its own (one build a process): their build key and what it logged."""
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(cache), march],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
        check=True,
    )
    return out.stdout.strip(), out.stderr
