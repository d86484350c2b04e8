"""Adaptive batching against the static policy, under open-loop load (issue 17's bench).

    python bench/adaptive_batching.py [--duration 60] [--rates 0.2,0.7,0.9] [--write]

Single-turn chats over /ws, each on its own connection, arriving as a Poisson process;
prompt lengths drawn log-uniformly from 30 to 2,000 tokens, replies of --max-tokens tokens.
First the capacity: completed requests per second of the static policy under a closed loop
of --capacity-users users. Then, for each rate (a fraction of that capacity), the very same
arrivals (times and prompts) against a server with `--batching static` and one with
`--batching adaptive`, one after the other, a fresh server each run. Reported per run: TTFT
p50/p99, inter-token p50/p99, completion tokens/s and requests done, and for the adaptive
server its inter-token target (from /metrics). With --write the table goes into
bench/README.md between the `adaptive-batching` markers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import re
import sys
import time
from pathlib import Path

import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import ROOT, start, stop, write_readme_block
from ws_load import WORDS, Recorder, Turn, client_headers, percentiles, receive_turn


def prompt_of(rng: random.Random, tokens: int) -> str:
    """About `tokens` prompt tokens with the chat template (each word is ~1 token)."""
    words = " ".join(rng.choice(WORDS) for _ in range(max(tokens - 24, 4)))
    return f"Summarize these words in one line: {words}"


def workload(seed: int, rate: float, duration: float) -> list[tuple[float, str]]:
    """Poisson arrivals over `duration` seconds: (time, prompt), the same for every policy."""
    rng = random.Random(f"{seed}/{rate}")
    arrivals, t = [], rng.expovariate(rate)
    while t < duration:
        tokens = round(math.exp(rng.uniform(math.log(30), math.log(2000))))
        arrivals.append((t, prompt_of(rng, tokens)))
        t += rng.expovariate(rate)
    return arrivals


async def one_turn(url: str, headers, prompt: str, n: int, max_tokens: int, rec: Recorder):
    turn = Turn(0, f"ab-{n}-{random.random()}", 1, time.monotonic())
    rec.turns.append(turn)
    frame = {
        "type": "chat",
        "id": "t1",
        "conversation_id": turn.conversation,
        "messages": [{"role": "user", "content": prompt}],
        "cache": False,  # nobody comes back: keep no K/V
        "params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True},
    }
    try:
        async with websockets.connect(url, max_size=None, additional_headers=headers) as ws:
            await ws.send(json.dumps(frame))
            await receive_turn(ws, turn, rec, "t1")
    except (OSError, websockets.WebSocketException) as exc:
        turn.error = type(exc).__name__
        rec.errors[turn.error] += 1


async def open_loop(url: str, arrivals, max_tokens: int) -> tuple[Recorder, float]:
    headers = client_headers(url, None)
    rec = Recorder()
    tasks = []
    for n, (at, prompt) in enumerate(arrivals):
        await asyncio.sleep(max(0.0, at - (time.monotonic() - rec.started)))
        tasks.append(asyncio.create_task(one_turn(url, headers, prompt, n, max_tokens, rec)))
    await asyncio.gather(*tasks)
    return rec, time.monotonic() - rec.started


async def closed_loop(url: str, users: int, seconds: float, max_tokens: int) -> float:
    """Requests completed per second by `users` users that each send the next at once."""
    headers = client_headers(url, None)
    rec = Recorder()
    rng = random.Random("capacity")
    end = time.monotonic() + seconds

    async def user(u: int) -> None:
        n = 0
        while time.monotonic() < end:
            tokens = round(math.exp(rng.uniform(math.log(30), math.log(2000))))
            await one_turn(url, headers, prompt_of(rng, tokens), u * 10_000 + n, max_tokens, rec)
            n += 1

    await asyncio.gather(*(user(u) for u in range(users)))
    wall = time.monotonic() - rec.started
    return sum(1 for t in rec.turns if t.finish_reason) / wall


def itl_target_ms(http: str) -> float | None:
    import httpx

    text = httpx.get(http + "/metrics", timeout=10).text
    m = re.search(r"^parley:itl_target_seconds (\S+)$", text, re.M)
    return float(m.group(1)) * 1000 if m else None


def summarize(rec: Recorder, wall: float, target: float | None) -> dict:
    ok = [t for t in rec.turns if t.finish_reason]
    ttft = percentiles([t.ttft_s for t in ok if t.ttft_s is not None])
    itl = percentiles([g for t in ok for g in t.itl_s])
    return {
        "requests": len(rec.turns),
        "done": len(ok),
        "errors": dict(rec.errors),
        "tok_s": sum(t.completion_tokens for t in ok) / wall,
        "ttft_p50": ttft["p50"],
        "ttft_p99": ttft["p99"],
        "itl_p50": itl["p50"],
        "itl_p99": itl["p99"],
        "prompt_tokens_mean": sum(t.prompt_tokens for t in ok) / max(len(ok), 1),
        "itl_target_ms": target,
        # each request: (sent, s after the run's start; prompt tokens; TTFT s), for the tail
        "turns": [
            (round(t.sent_at - rec.started, 3), t.prompt_tokens, t.ttft_s) for t in rec.turns
        ],
    }


def run_policy(policy: str, flags: list[str], arrivals, args) -> dict:
    proc, http = start(["--batching", policy, *flags])
    try:
        url = http.replace("http", "ws") + "/ws"
        rec, wall = asyncio.run(open_loop(url, arrivals, args.max_tokens))
        target = itl_target_ms(http) if policy == "adaptive" else None
        return summarize(rec, wall, target)
    finally:
        stop(proc)


def table(capacity: float, results: dict, args) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f}"

    rows = [
        "| load | policy | requests done | tok/s | TTFT p50 / p99 (ms) | inter-token p50 / p99 "
        "(ms) | ITL target (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = []
    for rate, pair in results.items():
        for policy in ("static", "adaptive"):
            s = pair[policy]
            target = "-" if s["itl_target_ms"] is None else f"{s['itl_target_ms']:.0f}"
            rows.append(
                f"| {rate}x ({rate * capacity:.2f} req/s) | {policy} | {s['done']}/{s['requests']}"
                f" | {s['tok_s']:.0f} | {ms(s['ttft_p50'])} / {ms(s['ttft_p99'])} | "
                f"{ms(s['itl_p50'])} / {ms(s['itl_p99'])} | {target} |"
            )
        st, ad = pair["static"], pair["adaptive"]
        itl_vs_target = (
            f"{ad['itl_p99'] * 1000 / ad['itl_target_ms']:.2f}x" if ad["itl_target_ms"] else "-"
        )
        ratios.append(
            f"- {rate}x: TTFT p99 {st['ttft_p99'] / ad['ttft_p99']:.2f}x lower, TTFT p50 "
            f"{st['ttft_p50'] / ad['ttft_p50']:.2f}x lower, throughput "
            f"{ad['tok_s'] / st['tok_s']:.2f}x, inter-token p50 "
            f"{ad['itl_p50'] / st['itl_p50']:.2f}x static's, inter-token p99 "
            f"{itl_vs_target} the target"
        )
    head = (
        f"`python bench/adaptive_batching.py --duration {args.duration:g} --max-tokens "
        f"{args.max_tokens}` ({platform.processor() or platform.machine()}, "
        f"{time.strftime('%Y-%m-%d')}; capacity of the static policy {capacity:.2f} req/s, "
        f"closed loop of {args.capacity_users}; prompts 30-2,000 tokens, log-uniform):"
    )
    return "\n".join([head, "", *rows, "", "Adaptive against static, same arrivals:", "", *ratios])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--rates", default="0.2,0.7,0.9", help="fractions of the capacity")
    ap.add_argument("--capacity", type=float, default=None, help="req/s (skip measuring it)")
    ap.add_argument("--capacity-users", type=int, default=8)
    ap.add_argument("--capacity-seconds", type=float, default=45.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-flags", default="", help="more flags for both servers")
    ap.add_argument("--out", default="bench/results/adaptive_batching.json")
    ap.add_argument("--write", action="store_true", help="put the table in bench/README.md")
    args = ap.parse_args()
    flags = args.server_flags.split()
    capacity = args.capacity
    if capacity is None:
        proc, http = start(["--batching", "static", *flags])
        try:
            url = http.replace("http", "ws") + "/ws"
            capacity = asyncio.run(
                closed_loop(url, args.capacity_users, args.capacity_seconds, args.max_tokens)
            )
        finally:
            stop(proc)
        print(f"capacity (static, closed loop of {args.capacity_users}): {capacity:.2f} req/s",
              file=sys.stderr)  # fmt: skip
    results: dict = {}
    for rate in (float(r) for r in args.rates.split(",")):
        arrivals = workload(args.seed, rate * capacity, args.duration)
        results[rate] = {}
        for policy in ("static", "adaptive"):
            results[rate][policy] = run_policy(policy, flags, arrivals, args)
            print(
                rate,
                policy,
                json.dumps({k: v for k, v in results[rate][policy].items() if k != "turns"}),
                file=sys.stderr,
            )
    text = table(capacity, results, args)
    print(text)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"capacity": capacity, "results": results}, indent=2))
    if args.write:
        write_readme_block("adaptive-batching", "Adaptive batching", text)


if __name__ == "__main__":
    main()
