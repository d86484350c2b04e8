"""Adaptive batching against the static policy, under open-loop load (issue 17's bench).

    python bench/adaptive_batching.py [--duration 60] [--rates 0.2,0.7,0.9] [--write]

Single-turn chats over /ws, each on its own connection, arriving as a Poisson process;
prompt lengths drawn log-uniformly from 30 to 2,000 tokens, replies of --max-tokens tokens.
First the capacity: completed requests per second of the static policy under a closed loop
of --capacity-users users. Then, for each rate (a fraction of that capacity), the very same
arrivals (times and prompts) against a server with `--batching static` and one with
`--batching adaptive`, one after the other, a fresh server each run. Reported per run: TTFT
p50/p99, inter-token p50/p99, completion tokens/s and requests done, and for the adaptive
server its inter-token target. The automatic target follows the decode step, so it moves
with the batch: /metrics is read every POLL_S during the run and each inter-token gap is
held against the target in force when it began.

The floor: how low any order could bring the TTFT p99 on the same arrivals
(bench/ttft_floor.py), from each prompt's time alone, measured on an idle server before the
runs (a quadratic in prompt tokens, fitted). A static p99 less than twice its floor means
no policy can make it 2x lower there. With --write the table goes into bench/README.md
between the `adaptive-batching` markers.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import platform
import random
import re
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import ROOT, start, stop, write_readme_block
from ttft_floor import ttft_floors
from ws_load import WORDS, Recorder, Turn, client_headers, percentiles, receive_turn

POLL_S = 0.25  # how often the run reads the server's inter-token target
LAG_TICK_S = 0.005  # the load client's own loop is probed this often (its lag: jitter)
CALIBRATION_TOKENS = (30, 250, 700, 1300, 2000)  # lone prompts timed for the floor


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


async def open_loop(url: str, http: str, arrivals, max_tokens: int):
    """The arrivals against the server; returns the recorder, the run's seconds, the
    inter-token targets read meanwhile, (monotonic time, seconds), the cost model's
    error and the plan margin read with them, and the client's own loop lag (s): how late
    a LAG_TICK_S sleep woke, which a gap the client measures may carry on top of the
    server's (client and server share this machine's cores), and the engine's own counts
    of inter-token gaps against the target (total, over 1.2x), read at the end."""
    headers = client_headers(url, None)
    rec = Recorder()
    targets: list[tuple[float, float]] = []
    model: list[tuple[float, float]] = []  # (cost model's error, plan margin), as read
    done = asyncio.Event()

    async def poll() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            while not done.is_set():
                text = (await client.get(http + "/metrics")).text
                target = gauge(text, "itl_target_seconds")
                if target is not None:
                    targets.append((time.monotonic(), target))
                    model.append(
                        (gauge(text, "step_cost_model_error"), gauge(text, "itl_plan_margin"))
                    )
                await asyncio.sleep(POLL_S)

    lags: list[float] = []

    async def probe() -> None:
        while not done.is_set():
            t = time.monotonic()
            await asyncio.sleep(LAG_TICK_S)
            lags.append(time.monotonic() - t - LAG_TICK_S)

    poller = asyncio.create_task(poll())
    prober = asyncio.create_task(probe())
    tasks = []
    for n, (at, prompt) in enumerate(arrivals):
        await asyncio.sleep(max(0.0, at - (time.monotonic() - rec.started)))
        tasks.append(asyncio.create_task(one_turn(url, headers, prompt, n, max_tokens, rec)))
    await asyncio.gather(*tasks)
    wall = time.monotonic() - rec.started
    done.set()
    await poller
    await prober
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(http + "/metrics")).text
    engine_gaps = (
        gauge(text, "itl_gaps_total"),
        gauge(text, 'itl_gaps_over_target_total{times="1.2"}'),
    )
    return rec, wall, targets, model, lags, engine_gaps


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


def gauge(metrics: str, name: str) -> float | None:
    m = re.search(rf"^parley:{re.escape(name)} (\S+)$", metrics, re.M)
    return float(m.group(1)) if m else None


def gaps_over_target(turns: list[Turn], targets: list[tuple[float, float]]) -> list[float]:
    """Each inter-token gap over the target in force when it began (the last one read
    before then; the first one read, for gaps before any)."""
    if not targets:
        return []
    times = [t for t, _ in targets]
    out = []
    for turn in turns:
        if turn.ttft_s is None:
            continue
        end = turn.sent_at + turn.ttft_s
        for gap in turn.itl_s:
            i = max(0, bisect.bisect_right(times, end) - 1)
            out.append(gap / targets[i][1])
            end += gap
    return out


def summarize(
    rec: Recorder,
    wall: float,
    targets: list[tuple[float, float]],
    model,
    lags: list[float],
    engine_gaps: tuple[float | None, float | None],
) -> dict:
    ok = [t for t in rec.turns if t.finish_reason]
    ttft = percentiles([t.ttft_s for t in ok if t.ttft_s is not None])
    itl = percentiles([g for t in ok for g in t.itl_s])
    ratios = gaps_over_target(ok, targets)
    over = percentiles(ratios)
    in_force = percentiles([x for _, x in targets])
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
        # the target read during the run: p50 and its range (p10, p90), and each gap
        # against the target in force: p99 of gap / target
        "itl_target_ms": None if in_force["p50"] is None else in_force["p50"] * 1000,
        "itl_target_range_ms": None
        if in_force["p50"] is None
        else [min(x for _, x in targets) * 1000, max(x for _, x in targets) * 1000],
        "itl_p99_over_target": over["p99"],
        # the cost model's mean relative error and the plan margin, p50 over the run
        "model_error": percentiles([e for e, _ in model if e])["p50"],
        "plan_margin": percentiles([m for _, m in model if m])["p50"],
        "client_lag_p99_ms": percentiles(lags)["p99"] * 1000 if lags else None,
        "client_over_1_2": sum(r > 1.2 for r in ratios) / len(ratios) if ratios else None,
        # the engine's own gaps (before delivery) over 1.2x the target: a fraction of
        # all; at most 1% means their p99 is within 1.2x the target
        "engine_over_1_2": engine_gaps[1] / engine_gaps[0] if engine_gaps[0] else None,
        # each request: (sent, s after the run's start; prompt tokens; TTFT s), for the tail
        "turns": [
            (round(t.sent_at - rec.started, 3), t.prompt_tokens, t.ttft_s) for t in rec.turns
        ],
    }


def run_policy(policy: str, flags: list[str], arrivals, args) -> dict:
    proc, http = start(["--batching", policy, *flags])
    try:
        url = http.replace("http", "ws") + "/ws"
        rec, wall, targets, model, lags, engine_gaps = asyncio.run(
            open_loop(url, http, arrivals, args.max_tokens)
        )
        return summarize(rec, wall, targets, model, lags, engine_gaps)
    finally:
        stop(proc)


async def lone_prompts(url: str, repeats: int = 2) -> list[tuple[int, float]]:
    """(prompt tokens, best TTFT) of prompts sent one at a time to an idle server."""
    headers = client_headers(url, None)
    rng = random.Random("calibration")
    out = []
    for tokens in CALIBRATION_TOKENS:
        prompt = prompt_of(rng, tokens)
        rec = Recorder()
        for r in range(repeats):
            await one_turn(url, headers, prompt, r, 1, rec)
        # One token: its frame, or the `done` frame when its text is held back (a piece
        # of a character), is the first the client hears.
        best = min(t.ttft_s or t.e2e_s for t in rec.turns if t.finish_reason)
        out.append((rec.turns[0].prompt_tokens, best))
    return out


def fit_prompt_time(points: list[tuple[int, float]]) -> dict:
    """TTFT alone ~ latency + per_token * n + per_pair * n^2 (non-negative), and the fit's
    largest relative error."""
    n = np.array([p for p, _ in points], dtype=float)
    y = np.array([t for _, t in points])
    x = np.column_stack([np.ones_like(n), n, n * n])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    coef = np.clip(coef, 0.0, None)
    error = float(np.max(np.abs(x @ coef - y) / y))
    return {"latency": coef[0], "per_token": coef[1], "per_pair": coef[2], "error": error,
            "points": points}  # fmt: skip


def floor_p99(fit: dict, turns) -> float:
    """The TTFT p99 no order could beat on these arrivals (bench/ttft_floor.py)."""
    sent = [at for at, _, _ in turns]
    work = [fit["per_token"] * n + fit["per_pair"] * n * n for _, n, _ in turns]
    return percentiles(ttft_floors(sent, work, fit["latency"]))["p99"]


def table(capacity: float, fit: dict, results: dict, args) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f}"

    def pct(x):
        return "-" if x is None else f"{x * 100:.1f}%"

    def num(x):
        return "-" if x is None else f"{x:.2f}"

    rows = [
        "| load | policy | requests done | tok/s | TTFT p50 / p99 (ms) | TTFT p99 floor (ms) "
        "| inter-token p50 / p99 (ms) | ITL target p50, range (ms) | inter-token p99 / target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = []
    for rate, pair in results.items():
        floor = pair["floor_p99"]
        for policy in ("static", "adaptive"):
            s = pair[policy]
            target, over = "-", "-"
            if s["itl_target_ms"] is not None:
                lo, hi = s["itl_target_range_ms"]
                target = f"{s['itl_target_ms']:.0f}, {lo:.0f}-{hi:.0f}"
                over = f"{s['itl_p99_over_target']:.2f}x"
            rows.append(
                f"| {rate}x ({rate * capacity:.2f} req/s) | {policy} | {s['done']}/{s['requests']}"
                f" | {s['tok_s']:.0f} | {ms(s['ttft_p50'])} / {ms(s['ttft_p99'])} | {ms(floor)} | "
                f"{ms(s['itl_p50'])} / {ms(s['itl_p99'])} | {target} | {over} |"
            )
        st, ad = pair["static"], pair["adaptive"]
        over = ad["itl_p99_over_target"]
        ratios.append(
            f"- {rate}x: TTFT p99 {st['ttft_p99'] / ad['ttft_p99']:.2f}x lower (any order: at "
            f"most {st['ttft_p99'] / floor:.2f}x, static's p99 over the floor), TTFT p50 "
            f"{st['ttft_p50'] / ad['ttft_p50']:.2f}x lower, throughput "
            f"{ad['tok_s'] / st['tok_s']:.2f}x, inter-token p50 "
            f"{ad['itl_p50'] / st['itl_p50']:.2f}x static's, inter-token p99 "
            f"{'-' if over is None else f'{over:.2f}x'} the target in force; the cost "
            f"model's error {pct(ad['model_error'])}, plan margin {num(ad['plan_margin'])}; "
            f"gaps over 1.2x the target {pct(ad['client_over_1_2'])} as the client saw them, "
            f"{pct(ad['engine_over_1_2'])} as the engine did; "
            f"the load client's own loop lag p99 {num(st['client_lag_p99_ms'])} / "
            f"{num(ad['client_lag_p99_ms'])} ms (static / adaptive)"
        )
    given = "" if args.capacity is None else f" --capacity {args.capacity!r}"
    head = (
        f"`python bench/adaptive_batching.py --duration {args.duration:g} --max-tokens "
        f"{args.max_tokens}{given}` ({platform.processor() or platform.machine()}, "
        f"{time.strftime('%Y-%m-%d')}; capacity of the static policy {capacity:.2f} req/s, "
        f"closed loop of {args.capacity_users}; prompts 30-2,000 tokens, log-uniform; a lone "
        f"prompt's TTFT {fit['latency'] * 1000:.0f} ms + {fit['per_token'] * 1e6:.0f} us a "
        f"token + {fit['per_pair'] * 1e9:.2f} ns a token pair, fit within "
        f"{fit['error'] * 100:.0f}%):"
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
    proc, http = start(["--batching", "static", *flags])
    try:
        url = http.replace("http", "ws") + "/ws"
        fit = fit_prompt_time(asyncio.run(lone_prompts(url)))
        print(f"a lone prompt: {fit}", file=sys.stderr)
        if capacity is None:
            capacity = asyncio.run(
                closed_loop(url, args.capacity_users, args.capacity_seconds, args.max_tokens)
            )
            print(f"capacity (static, closed loop of {args.capacity_users}): "
                  f"{capacity:.2f} req/s", file=sys.stderr)  # fmt: skip
    finally:
        stop(proc)
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
        results[rate]["floor_p99"] = floor_p99(fit, results[rate]["static"]["turns"])
    text = table(capacity, fit, results, args)
    print(text)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"capacity": capacity, "fit": fit, "results": results}, indent=2))
    if args.write:
        write_readme_block("adaptive-batching", "Adaptive batching", text)


if __name__ == "__main__":
    main()
