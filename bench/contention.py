"""Speed on a busy machine: the same server measured quiet, beside busy processes, and quiet
again, in one run, with the thread count it chose over time.

    python bench/contention.py                        # Parley, and Parley pinned at --threads N
    python bench/contention.py --llama-server PATH    # and llama-server on the same GGUF
    python bench/contention.py --quick --write        # fewer tokens; table into bench/README.md

A busy neighbour is `python -c "while True: pass"` at the same priority (a browser tab, an
IDE indexing, a build). Phases, each on the same running servers: quiet, 1 busy process,
2 busy processes (where there are >= 2 CPUs... and at most the CPU count), quiet again. In
each phase: one stream, 8 and 32 concurrent streams (128 tokens with ignore_eos, the same
OpenAI streaming client for every server). "pinned" is Parley with --threads set to the CPU
count: the behaviour before the thread policy, measured in the same run as the baseline
for "quiet numbers unchanged". The adaptation: how long after a neighbour starts the
count drops, and after it stops until a stream runs >= 0.95x its quiet speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from servers import free_port, start, stop, wait_ready, write_readme_block  # noqa: E402
from vs_llama_cpp import concurrent, decode_rate, stream_chat  # noqa: E402

CPUS = len(os.sched_getaffinity(0))


class ThreadLog:
    """Polls a Parley server's parley:cpu_threads a few times a second, in the background."""

    def __init__(self, url: str) -> None:
        self.url, self.samples = url, []  # (time, threads)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.wait(0.2):
                try:
                    text = client.get(self.url + "/metrics").text
                except httpx.HTTPError:
                    continue
                m = re.search(r"^parley:cpu_threads (\S+)$", text, re.M)
                if m:
                    self.samples.append((time.monotonic(), int(float(m.group(1)))))

    def at(self, t: float) -> int | None:
        before = [n for s, n in self.samples if s <= t]
        return before[-1] if before else None

    def first_change_after(self, t: float, away_from: int) -> float | None:
        for s, n in self.samples:
            if s > t and n != away_from:
                return s - t
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Neighbours:
    """`count` processes spinning at our priority."""

    def __init__(self, count: int) -> None:
        self.count, self.procs = count, []

    def __enter__(self) -> Neighbours:
        code = "while True: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.count)]
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.stopped = time.monotonic()


async def one_stream(client, model: str, tokens: int) -> float:
    s, _ = await stream_chat(client, model, [{"role": "user", "content": "Tell a story."}], tokens)
    return decode_rate(s)


def client_for(base: str):
    """An OpenAI client with a connection a request: llama-server (cpp-httplib) closes a
    kept-alive connection after a few requests, and a request sent on it then fails."""
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=600)
    return AsyncOpenAI(base_url=base, api_key="none", max_retries=0, http_client=http)


async def measure(base: str, model: str, tokens: int) -> dict[str, float]:
    async with client_for(base) as client:
        model = (await client.models.list()).data[0].id
        await one_stream(client, model, 8)  # warm
        out = {"1": await one_stream(client, model, tokens)}
        for n in (8, 32):
            out[str(n)] = (await concurrent(client, model, n, tokens))["tok_s"]
    return out


async def recovery(base: str, model: str, quiet: float, tokens: int, limit_s: float) -> float:
    """Seconds from now until one stream decodes at >= 0.95x `quiet` (short streams back
    to back); nan if not within limit_s."""
    started = time.monotonic()
    async with client_for(base) as client:
        model = (await client.models.list()).data[0].id
        while time.monotonic() - started < limit_s:
            s, _ = await stream_chat(client, model, [{"role": "user", "content": "Hi."}], tokens)
            if len(s.stamps) > 1 and decode_rate(s) >= 0.95 * quiet:
                return time.monotonic() - started
    return float("nan")


class LlamaServer:
    def __init__(self, binary: str, gguf: Path, threads: int) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}/v1"
        cmd = [binary, "-m", str(gguf), "--port", str(self.port), "-t", str(threads),
               "-c", "16384", "-np", "32", "--log-disable"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(self.proc, self.base + "/models", "llama-server")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--quick", action="store_true", help="64 tokens a stream instead of 128")
    ap.add_argument("--write", action="store_true", help="the table into bench/README.md")
    args = ap.parse_args()
    # A SIGTERM unwinds like Ctrl-C, so that the servers started below are stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    tokens = 64 if args.quick else 128
    from app.config import ModelConfig
    from app.model.registry import default_model_path

    gguf = default_model_path(ModelConfig().cache_dir)
    servers: dict[str, str] = {}
    procs = []
    proc, url = start(["--kv-cache-size", "1GiB"])
    procs.append(proc)
    servers["Parley"] = url + "/v1"
    log = ThreadLog(url)
    proc, url = start(["--kv-cache-size", "1GiB", "--threads", str(CPUS)])
    procs.append(proc)
    servers[f"Parley --threads {CPUS} (before)"] = url + "/v1"
    llama = None
    if args.llama_server:
        llama = LlamaServer(args.llama_server, gguf, CPUS)
        servers[f"llama-server -t {CPUS}"] = llama.base
    phases = [
        ("quiet", 0),
        *[(f"{k} busy", k) for k in range(1, min(2, CPUS) + 1)],
        ("quiet again", 0),
    ]
    results: dict[str, dict[str, dict[str, float]]] = {}
    adapt: dict[str, float | None] = {}
    try:
        for phase, busy in phases:
            with Neighbours(busy) as nb:
                for name, base in servers.items():
                    results.setdefault(name, {})[phase] = asyncio.run(measure(base, "m", tokens))
                    print(phase, name, results[name][phase], flush=True)
                if busy:
                    adapt[phase] = log.first_change_after(nb.started, CPUS)
            if busy:  # the neighbours just left: how long until Parley is back to quiet speed
                quiet = results["Parley"]["quiet"]["1"]
                adapt[f"{phase} recovery"] = asyncio.run(
                    recovery(servers["Parley"], "m", quiet, 32, 30.0)
                )
    finally:
        log.close()
        for p in procs:
            stop(p)
        if llama:
            llama.stop()
    text = table(results, adapt, log, tokens)
    print(text)
    if args.write:
        write_readme_block("contention", "Speed on a busy machine", text)


def table(results, adapt, log: ThreadLog, tokens: int) -> str:
    names = list(results)
    phases = list(results[names[0]])
    lines = [
        f"{CPUS} CPUs, {tokens} tokens a stream, ignore_eos; tok/s (one stream: its decode "
        "rate; 8 and 32: all streams' tokens over the wall time); in brackets: x the same "
        "server's quiet speed.",
        "",
        "| server | streams | " + " | ".join(phases) + " |",
        "| --- | --- | " + " | ".join("---" for _ in phases) + " |",
    ]
    for name in names:
        for n in ("1", "8", "32"):
            quiet = results[name]["quiet"][n]
            cells = [
                f"{results[name][p][n]:.1f} ({results[name][p][n] / quiet:.2f}x)" for p in phases
            ]
            lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    parley = names[0]
    lines += ["", "Against the others in the same phase:", ""]
    for other in names[1:]:
        for p in phases:
            ratios = [results[parley][p][n] / results[other][p][n] for n in ("1", "8", "32")]
            lines.append(f"- {p}: Parley / {other}: " + ", ".join(f"{r:.2f}x" for r in ratios)
                         + " (1, 8, 32 streams)")  # fmt: skip
    lines += ["", "Adaptation (Parley):", ""]
    for k, v in adapt.items():
        what = "count changed after" if "recovery" not in k else "back to >= 0.95x quiet after"
        lines.append(f"- {k}: {what} " + ("never" if v is None or v != v else f"{v:.1f} s"))
    if log.samples:
        t0 = log.samples[0][0]
        changes = [(t - t0, n) for (t, n), (_, m) in zip(log.samples[1:], log.samples) if n != m]
        lines.append(
            "- thread count over time (s: count): " + ", ".join(f"{t:.0f}: {n}" for t, n in changes)
            if changes
            else "- thread count never changed"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
