"""What the benchmarks share: a free loopback port, a server process started and awaited,
`python -m app` started and stopped, and a table written between markers in
bench/README.md."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, what: str, timeout: float = 600) -> None:
    """Until GET `url` answers 200; raises if the process exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.3)


def start(flags: list[str], root: Path = ROOT, **popen) -> tuple[subprocess.Popen, str]:
    """`python -m app` from the checkout at `root` on a free loopback port, in a session of
    its own (so that its Ray processes go with it), once /ready answers: the process and its
    base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "app", "--port", str(port), "--log-level", "warning", *flags]
    if root != ROOT:
        popen["env"] = {**popen.get("env", os.environ), "PYTHONPATH": str(root)}
    proc = subprocess.Popen(cmd, cwd=root, start_new_session=True, **popen)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url + "/ready", f"python -m app {' '.join(flags)}")
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process's session, SIGKILL if it is not gone within a minute."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def write_readme_block(name: str, title: str, text: str) -> None:
    """Put `text` into bench/README.md between the `<!-- name:begin/end -->` markers, or
    append it under `## title` where the markers are not there yet."""
    path = ROOT / "bench" / "README.md"
    readme = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{text}\n{end}"
    if begin in readme:
        readme = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, readme,
                        flags=re.S)  # fmt: skip
    else:
        readme += f"\n## {title}\n\n{block}\n"
    path.write_text(readme)
