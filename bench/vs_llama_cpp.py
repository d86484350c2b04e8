"""Parley against llama.cpp's llama-server on the same GGUF file, driven by the same OpenAI
streaming client in one script, the two servers' runs alternating.

    python bench/vs_llama_cpp.py --llama-server /path/to/llama-server
    LLAMA_SERVER=/path/to/llama-server python bench/vs_llama_cpp.py --quick

llama-server is not part of Parley: build it once from the llama.cpp sources inside the
PyPI sdist of llama-cpp-python (about 20 minutes on 2 cores):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    cmake --build build --target llama-server -j2

Scenarios: one stream (decode tok/s, TTFT); 8 and 32 concurrent streams (aggregate tok/s,
TTFT and inter-token p50/p99); 8 conversations x 6 turns that resend their history; a
1,500-token and a 4,400-token prompt, each then a follow-up; a ~6,000-token prompt then
128 tokens (deep in a long chat); peak RSS of each server. --gguf FILE runs both servers
on that file (bench/make_gguf.py writes bigger random-weight ones). Each scenario takes
the median of --repeats runs. The table goes to stdout and, with --write, into
bench/README.md between its markers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from servers import free_port, wait_ready, write_readme_block  # noqa: E402

FILLER = (
    "The keeper of the lighthouse wrote in his log every evening: the weather, the ships "
    "that passed, the state of the lamp and the oil, and whatever else the day had brought. "
)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    """A server process on a free loopback port, ready when /v1/models answers."""

    def __init__(self, name: str, cmd: list[str], port: int, cwd: Path | None = None) -> None:
        self.name, self.port = name, port
        self.base = f"http://127.0.0.1:{port}/v1"
        # Its output goes to a temporary file, named when a scenario fails.
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (open while the server runs)
            prefix=f"{name}-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd)
        wait_ready(self.proc, self.base + "/models", f"{name} ({' '.join(cmd)})")

    def state(self) -> str:
        code = self.proc.poll()
        alive = "running" if code is None else f"exited with {code}"
        return f"{self.name}: {alive}, output in {self.log.name}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


@dataclass
class Stream:
    sent: float
    stamps: list[float] = field(default_factory=list)  # when each piece of text came
    tokens: int | None = None  # the reply's tokens, as the server's usage counts them

    @property
    def num_tokens(self) -> int:
        # Text pieces are not tokens: a detokenizer holds back a token that ends mid-word
        # or mid-character and sends it with the next, so counting pieces would tie a rate
        # to the reply's text.
        return self.tokens if self.tokens is not None else len(self.stamps)

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


async def stream_chat(client, model: str, messages, max_tokens: int) -> tuple[Stream, str]:
    s = Stream(time.perf_counter())
    text = []
    response = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in response:
        if chunk.choices and chunk.choices[0].delta.content:
            s.stamps.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            s.tokens = chunk.usage.completion_tokens
    return s, "".join(text)


def decode_rate(s: Stream) -> float:
    """Tokens a second from the first piece of text to the last (the first token's time
    is the time to first token)."""
    return (s.num_tokens - 1) / (s.stamps[-1] - s.stamps[0])


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def concurrent(client, model: str, n: int, tokens: int) -> dict:
    started = time.perf_counter()
    runs = await asyncio.gather(
        *(stream_chat(client, model, ask(f"Tell me a story about island {i}."), tokens)
          for i in range(n))
    )  # fmt: skip
    wall = time.perf_counter() - started
    streams = [s for s, _ in runs]
    gaps = [g for s in streams for g in s.gaps]
    return {
        "tok_s": sum(s.num_tokens for s in streams) / wall,
        "decode_tok_s": statistics.median(decode_rate(s) for s in streams),
        "ttft_s": statistics.median(s.ttft for s in streams),
        "itl_p50_ms": percentile(gaps, 0.5) * 1000,
        "itl_p99_ms": percentile(gaps, 0.99) * 1000,
    }


async def multi_turn(client, model: str, users: int, turns: int, tokens: int) -> dict:
    async def user(u: int) -> None:
        messages: list[dict[str, str]] = []
        for t in range(turns):
            messages.append({"role": "user", "content": f"User {u}, question {t}: " + FILLER})
            _, reply = await stream_chat(client, model, messages, tokens)
            messages.append({"role": "assistant", "content": reply})

    started = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(users)))
    return {"total_s": time.perf_counter() - started}


async def long_then_follow_up(client, model: str, prompt_tokens: int, salt: str) -> dict:
    # ~36 tokens per FILLER: a prompt of about `prompt_tokens` tokens, new each run.
    long = f"[{salt}] " + FILLER * (prompt_tokens // 36) + "\nSummarize the log."
    first, reply = await stream_chat(client, model, ask(long), 16)
    follow = [*ask(long), {"role": "assistant", "content": reply},
              {"role": "user", "content": "And the weather?"}]  # fmt: skip
    second, _ = await stream_chat(client, model, follow, 16)
    return {"ttft_s": first.ttft, "follow_up_ttft_s": second.ttft}


async def deep_chat(client, model: str, prompt_tokens: int, tokens: int, salt: str) -> dict:
    long = f"[{salt}] " + FILLER * (prompt_tokens // 36) + "\nContinue the log."
    s, _ = await stream_chat(client, model, ask(long), tokens)
    return {"decode_tok_s": decode_rate(s), "ttft_s": s.ttft}


def median_of(results: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


async def scenario(servers: list[Server], name: str, make, repeats: int) -> dict[str, dict]:
    """Run `make(client, model, run)` against each server in turn, `repeats` times."""
    import openai

    got: dict[str, list[dict]] = {s.name: [] for s in servers}
    for run in range(repeats):
        for s in servers if run % 2 == 0 else servers[::-1]:
            # A connection a request: llama-server (cpp-httplib) closes a kept-alive
            # connection after a few requests, and a request sent on it as it closes fails
            # ("Connection error", always in the turns scenario: 6 requests a user).
            http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0),
                                     timeout=1200)  # fmt: skip
            client = openai.AsyncOpenAI(base_url=s.base, api_key="unused", max_retries=0,
                                        http_client=http)  # fmt: skip
            try:
                model = (await client.models.list()).data[0].id
                got[s.name].append(await make(client, model, f"{name}-{run}"))
            except Exception as exc:
                states = "; ".join(x.state() for x in servers)
                raise RuntimeError(f"{name}, run {run}, against {s.name}: {states}") from exc
            finally:
                await client.close()
    out = {k: median_of(v) for k, v in got.items()}
    print(f"{name}: {json.dumps(out)}", file=sys.stderr)
    return out


# Each scenario: a name and, given the tokens a reply decodes, what one run of it does.
SCENARIOS = {
    "one": lambda t: lambda c, m, run: concurrent(c, m, 1, t),
    "c8": lambda t: lambda c, m, run: concurrent(c, m, 8, t),
    "c32": lambda t: lambda c, m, run: concurrent(c, m, 32, t),
    "turns": lambda t: lambda c, m, run: multi_turn(c, m, 8, 6, 64),
    "long": lambda t: lambda c, m, run: long_then_follow_up(c, m, 1500, run),
    "long4400": lambda t: lambda c, m, run: long_then_follow_up(c, m, 4400, run),
    "deep": lambda t: lambda c, m, run: deep_chat(c, m, 6000, t, run),
}


def run_scenarios(servers: list[Server], names: list[str], args: argparse.Namespace) -> dict:
    """The named scenarios in order, each against every server, `args.repeats` times."""
    return {
        name: asyncio.run(scenario(servers, name, SCENARIOS[name](args.tokens), args.repeats))
        for name in names
    }


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", text)
    flags = set(re.search(r"flags\s*:\s*(.*)", text).group(1).split())
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model.group(1) if model else platform.processor()} ({', '.join(shown)})"


def row(label: str, a: float, b: float, unit: str, better: str, target: str = "") -> str:
    ratio = a / b if b else float("nan")
    return f"| {label} | {a:.2f} {unit} | {b:.2f} {unit} | **{ratio:.2f}x** ({better}) | {target} |"


def table(r: dict, cpu: str, parley_flags: str, llama_flags: str) -> str:
    P, L = "parley", "llama"
    lines = [
        f"Machine: {cpu}, {os.cpu_count()} cores; Python {platform.python_version()}; "
        f"measured {time.strftime('%Y-%m-%d')}. Parley `python -m app {parley_flags}`; "
        f"llama-server `{llama_flags}`. Medians of the runs; the two servers alternate.",
        "",
        "| scenario | Parley | llama-server | Parley / llama | target |",
        "| --- | --- | --- | --- | --- |",
        row("one stream, decode", r["one"][P]["decode_tok_s"], r["one"][L]["decode_tok_s"],
            "tok/s", "higher is better", ">= 1.0x"),
        row("one stream, TTFT", r["one"][P]["ttft_s"], r["one"][L]["ttft_s"], "s",
            "lower is better", "<= 1.0x"),
        row("deep chat (~6,000-token prompt), decode", r["deep"][P]["decode_tok_s"],
            r["deep"][L]["decode_tok_s"], "tok/s", "higher is better", ">= 1.0x"),
        row("8 concurrent, aggregate", r["c8"][P]["tok_s"], r["c8"][L]["tok_s"], "tok/s",
            "higher is better", ">= 1.5x"),
        row("32 concurrent, aggregate", r["c32"][P]["tok_s"], r["c32"][L]["tok_s"], "tok/s",
            "higher is better", ">= 2.0x"),
        row("8 x 6 multi-turn, total time", r["turns"][P]["total_s"], r["turns"][L]["total_s"],
            "s", "lower is better", "<= 0.8x"),
        row("1,500-token prompt, TTFT", r["long"][P]["ttft_s"], r["long"][L]["ttft_s"], "s",
            "lower is better", "<= 0.25x"),
        row("... its follow-up, TTFT", r["long"][P]["follow_up_ttft_s"],
            r["long"][L]["follow_up_ttft_s"], "s", "lower is better", "<= 0.5x"),
        row("4,400-token prompt, TTFT", r["long4400"][P]["ttft_s"],
            r["long4400"][L]["ttft_s"], "s", "lower is better", "<= 0.3x"),
        row("... its follow-up, TTFT", r["long4400"][P]["follow_up_ttft_s"],
            r["long4400"][L]["follow_up_ttft_s"], "s", "lower is better", "<= 0.5x"),
        row("peak RSS", r["rss"][P], r["rss"][L], "MiB", "lower is better", ""),
        "",
        "Latency under load (TTFT median, inter-token p50 / p99):",
        "",
        "| | Parley | llama-server |",
        "| --- | --- | --- |",
    ]  # fmt: skip
    for key, label in (("c8", "8 concurrent"), ("c32", "32 concurrent")):
        cells = [
            f"{r[key][k]['ttft_s']:.2f} s, {r[key][k]['itl_p50_ms']:.0f} / "
            f"{r[key][k]['itl_p99_ms']:.0f} ms"
            for k in (P, L)
        ]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def parley_only(args: argparse.Namespace) -> None:
    """Parley's side of the comparison alone (no ratio to llama-server: its side is
    missing). With --against ROOT, a second Parley from that checkout runs the same
    scenarios, alternating, and the ratios are to it."""
    if args.quick:
        args.repeats, args.tokens = 1, 48
    model_flags = ["--model", args.gguf] if args.gguf else []
    servers = []
    for name, root in [("parley", ROOT)] + ([("before", args.against)] if args.against else []):
        port = free_port()
        cmd = [sys.executable, "-m", "app", "--port", str(port), "--log-level", "warning",
               *model_flags, *args.parley_flags.split()]  # fmt: skip
        servers.append(Server(name, cmd, port, cwd=root))
    try:
        results = run_scenarios(servers, ["one", "c32", "long", "long4400"], args)
        results["rss"] = {s.name: peak_rss_mib(s.proc.pid) for s in servers}
    finally:
        for s in servers:
            s.stop()
    print(f"Parley `python -m app {' '.join(model_flags)} {args.parley_flags}` on "
          f"{cpu_flags()}, {os.cpu_count()} cores, medians of {args.repeats}:")  # fmt: skip
    for s in servers:
        one, c32 = results["one"][s.name], results["c32"][s.name]
        long, long4400 = results["long"][s.name], results["long4400"][s.name]
        print(
            f"  {s.name}: one stream {one['decode_tok_s']:.1f} tok/s decode (TTFT "
            f"{one['ttft_s']:.2f} s); 32 concurrent {c32['tok_s']:.1f} tok/s aggregate; "
            f"1,500-token prompt TTFT {long['ttft_s']:.2f} s (follow-up "
            f"{long['follow_up_ttft_s']:.3f} s); 4,400-token prompt TTFT "
            f"{long4400['ttft_s']:.2f} s (follow-up {long4400['follow_up_ttft_s']:.3f} s); "
            f"peak RSS {results['rss'][s.name]:.0f} MiB"
        )
    if args.against:
        ratio = {k: results[k]["parley"][m] / results[k]["before"][m]
                 for k, m in [("one", "decode_tok_s"), ("c32", "tok_s"), ("long", "ttft_s"),
                              ("long4400", "ttft_s")]}  # fmt: skip
        print(
            f"  this checkout / {args.against}: one stream {ratio['one']:.2f}x, 32 concurrent "
            f"{ratio['c32']:.2f}x (higher is better); 1,500-token TTFT {ratio['long']:.2f}x, "
            f"4,400-token TTFT {ratio['long4400']:.2f}x (lower is better)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--gguf", default=None, help="default: the default model's GGUF file")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="one run, fewer tokens")
    ap.add_argument("--parley-flags", default="", help="extra flags for python -m app")
    ap.add_argument("--write", action="store_true", help="put the table into bench/README.md")
    ap.add_argument("--out", default="bench/results/vs_llama_cpp.json")
    ap.add_argument(
        "--parley-only",
        action="store_true",
        help="where llama-server is not built: Parley's one stream, 32 concurrent, the "
        "1,500- and 4,400-token prompts and peak RSS",
    )
    ap.add_argument(
        "--against",
        type=Path,
        default=None,
        help="with --parley-only: also run Parley from this checkout (an older commit), "
        "alternating, and give the ratios to it",
    )
    args = ap.parse_args()
    if args.parley_only:
        parley_only(args)
        return
    if not args.llama_server or not Path(args.llama_server).exists():
        sys.exit(
            "llama-server not found: pass --llama-server PATH or set LLAMA_SERVER. Build it "
            "as the top of this file says (bench/vs_llama_cpp.py)."
        )
    if args.quick:
        args.repeats, args.tokens = 1, 48
    model_flags = ["--model", args.gguf] if args.gguf else []  # Parley: the same file
    from app.config import default_cache_dir
    from app.model.registry import default_model_path, known_model, model_path

    named = None if args.gguf is None or Path(args.gguf).exists() else known_model(args.gguf)
    if args.gguf is None:
        args.gguf = str(default_model_path(default_cache_dir()))
    elif named is not None:  # a registry name: llama-server takes only the file
        args.gguf = str(model_path(named, default_cache_dir()))

    llama_port, parley_port = free_port(), free_port()
    llama_cmd = [args.llama_server, "-m", args.gguf, "-t", "2", "-tb", "2", "-np", "32",
                 "-c", "65536", "--cont-batching", "--kv-unified", "--host", "127.0.0.1",
                 "--port", str(llama_port)]  # fmt: skip
    parley_cmd = [sys.executable, "-m", "app", "--port", str(parley_port),
                  "--log-level", "warning", *model_flags, *args.parley_flags.split()]  # fmt: skip
    servers = [Server("llama", llama_cmd, llama_port), Server("parley", parley_cmd, parley_port)]
    try:
        results = run_scenarios(servers, list(SCENARIOS), args)
        results["rss"] = {s.name: peak_rss_mib(s.proc.pid) for s in servers}
    finally:
        for s in servers:
            s.stop()
    llama_flags = " ".join(["llama-server", *llama_cmd[1:]]).replace(
        args.gguf, Path(args.gguf).name
    )
    flags = " ".join(["--model", Path(args.gguf).name] if model_flags else []) + (
        " " + args.parley_flags if args.parley_flags else ""
    )
    text = table(results, cpu_flags(), flags.strip() or "(default flags)", llama_flags)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    if args.write:
        name = "vs-llama-cpp" if not model_flags else f"vs-llama-cpp-{Path(args.gguf).stem}"
        write_readme_block(name, f"Against llama.cpp: `vs_llama_cpp.py` ({Path(args.gguf).name})",
                           text)  # fmt: skip


if __name__ == "__main__":
    main()
