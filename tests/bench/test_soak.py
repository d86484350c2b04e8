"""The 60-second soak (the 10-minute one is recorded in bench/README.md): `python -m app`
with the default model in its own process, mixed traffic with cancels and dropped
connections, then no unexpected error, no block held, flat resident memory."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_soak_60_seconds(tmp_path, smollm):  # smollm: the model is fetched and converted
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--kv-cache-size",
            "512MiB",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 600  # a shared machine can be slow to load a model
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        out = tmp_path / "soak.json"
        result = subprocess.run(
            [
                sys.executable,
                str(ROOT / "bench" / "ws_load.py"),
                "--soak",
                "--url",
                f"ws://127.0.0.1:{port}/ws",
                "--duration",
                "60",
                "--users",
                "6",
                "--turns",
                "4",
                "--max-tokens",
                "32",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        soak = json.loads(out.read_text())["runs"]["soak"]["soak"]
        assert result.returncode == 0, result.stdout[-3000:]
        assert soak["passed"] and not soak["unexpected_errors"]
        assert soak.get("cancels", 0) > 0 and soak.get("disconnects", 0) > 0
        assert not any(soak["server_after"].values())
        assert soak["rss_growth"] <= 0.05
    finally:
        server.terminate()
        server.wait(timeout=30)
