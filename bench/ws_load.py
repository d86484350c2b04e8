"""WebSocket load test: many simulated users holding multi-turn conversations over /ws.

    python bench/ws_load.py --url ws://127.0.0.1:8000/ws --users 8 --turns 6
    python bench/ws_load.py --users 8 --turns 6 --think 0 --compare-no-reuse --plot

Each user holds a conversation of --turns turns: it sends a user message built from the
seed (mostly short questions, now and then a long paste), waits for the whole reply, thinks
for an exponentially distributed time (mean --think seconds) and goes on. Closed loop: a
fixed number of users, each starting a new conversation when one ends. Open loop (--rate):
new conversations arrive as a Poisson process. A run ends after --duration seconds or
--conversations conversations (by default one per user), and always stops by itself
(--timeout).

Per turn it records time to first token, inter-token gaps, end-to-end latency and the
prompt / cached / completion tokens the server reports; it prints p50/p90/p99 and TTFT by
turn index, writes a JSON file, and with --plot a PNG. --compare-no-reuse runs the same
workload again with `cache: false` (no K/V kept between turns) and prints both side by side.

--soak runs mixed traffic for --duration seconds (conversations of random length, random
reply lengths, random cancels and dropped connections), then deletes every conversation it
made and checks the server: no unexpected errors, no request left, no block held, and a
resident memory growth of at most 5% after the warm-up (from /metrics). It exits non-zero
when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import websockets

WORDS = [
    "river",
    "mountain",
    "engine",
    "signal",
    "garden",
    "lantern",
    "harbor",
    "circuit",
    "meadow",
    "crystal",
    "thunder",
    "pocket",
    "orbit",
    "candle",
    "ladder",
    "mirror",
    "velvet",
    "compass",
    "marble",
    "echo",
    "ribbon",
    "canyon",
    "falcon",
    "glacier",
    "quartz",
    "saddle",
    "timber",
    "violet",
    "willow",
    "anchor",
    "beacon",
    "cobalt",
    "dune",
    "ember",
    "fjord",
]
QUESTIONS = [
    "What is a good name for a {w} shop?",
    "Explain what a {w} is in one sentence.",
    "Give me two fun facts about the {w}.",
    "Write a short poem about a {w}.",
    "How would you describe a {w} to a child?",
    "List three words that rhyme with {w}.",
]


@dataclass
class Turn:
    """One turn, as the client saw it."""

    user: int
    conversation: str
    index: int  # 1-based turn number within its conversation
    sent_at: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tier_cached_tokens: int = 0  # of cached_tokens, loaded from the server's KV tier
    completion_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    # A frame's gap since the previous one, split evenly over the tokens it carries (one
    # a frame unless the server gathers them: --stream-interval); frame_gap_s unsplit.
    itl_s: list[float] = field(default_factory=list)
    frame_gap_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    reply: str = ""


def user_message(seed: int, user: int, conversation: int, turn: int, paste_p: float) -> str:
    """Deterministic from its coordinates: the same workload every run."""
    rng = random.Random(f"{seed}/{user}/{conversation}/{turn}")
    if turn > 1 and rng.random() < paste_p:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(150, 300)))
        return f"Here is a note I wrote, summarize it in one line:\n\n{words}"
    return rng.choice(QUESTIONS).format(w=rng.choice(WORDS))


class Recorder:
    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.errors: Counter[str] = Counter()
        self.tokens = 0
        self.started = time.monotonic()

    def progress(self) -> str:
        elapsed = time.monotonic() - self.started
        done = sum(1 for t in self.turns if t.finish_reason or t.error)
        return (
            f"\r{elapsed:6.1f}s  turns done {done:5d}  errors {sum(self.errors.values()):3d}  "
            f"{self.tokens / elapsed if elapsed else 0:7.1f} tok/s"
        )


async def converse(url: str, user: int, number: int, args, rec: Recorder, cache: bool) -> None:
    """One conversation of args.turns turns on its own connection."""
    conversation = f"load-{args.seed}-{'c' if cache else 'n'}-{user}-{number}"
    messages: list[dict[str, str]] = []
    rng = random.Random(f"think/{args.seed}/{user}/{number}")
    async with websockets.connect(url, max_size=None, additional_headers=args.headers) as ws:
        for index in range(1, args.turns + 1):
            text = user_message(args.seed, user, number, index, args.paste_probability)
            messages.append({"role": "user", "content": text})
            turn = Turn(user, conversation, index, time.monotonic())
            rec.turns.append(turn)
            frame = {
                "type": "chat",
                "id": f"t{index}",
                "conversation_id": conversation,
                "messages": messages,
                "cache": cache,
                "params": {
                    "temperature": 0,
                    "max_tokens": args.max_tokens,
                    "ignore_eos": args.ignore_eos,
                },
            }
            await ws.send(json.dumps(frame))
            reply = await receive_turn(ws, turn, rec, f"t{index}")
            turn.reply = reply
            if turn.error:
                return
            messages.append({"role": "assistant", "content": reply})
            if args.think > 0 and index < args.turns:
                await asyncio.sleep(rng.expovariate(1 / args.think))
        await ws.send(json.dumps({"type": "delete", "conversation_id": conversation}))


async def receive_turn(ws, turn: Turn, rec: Recorder, turn_id: str | None = None) -> str:
    """Frames of one turn until its done or error (frames of other turns are skipped)."""
    parts: list[str] = []
    last = None
    tokens_seen = 0
    while True:
        f = json.loads(await ws.recv())
        now = time.monotonic()
        if turn_id is not None and f.get("id") not in (turn_id, None):
            continue
        if f.get("type") == "start":
            turn.prompt_tokens, turn.cached_tokens = f["prompt_tokens"], f["cached_tokens"]
            turn.tier_cached_tokens = f.get("tier_cached_tokens", 0)
        elif f.get("type") == "token":
            count = f.get("completion_tokens")
            carried = 1 if count is None else max(count - tokens_seen, 1)
            tokens_seen = count if count is not None else tokens_seen + 1
            if turn.ttft_s is None:
                turn.ttft_s = now - turn.sent_at
            elif last is not None:
                turn.itl_s += [(now - last) / carried] * carried
                turn.frame_gap_s.append(now - last)
            last = now
            parts.append(f["text"])
        elif f.get("type") == "done":
            turn.e2e_s = now - turn.sent_at
            turn.completion_tokens = f["usage"]["completion_tokens"]
            turn.finish_reason = f["finish_reason"]
            rec.tokens += turn.completion_tokens
            return "".join(parts)
        elif f.get("type") == "error":
            turn.error = f.get("code", "error")
            rec.errors[turn.error] += 1
            return ""


async def run(args, cache: bool) -> dict:
    rec = Recorder()
    conversations = args.conversations or (args.users if not args.duration else 10**9)
    deadline = rec.started + (args.duration or float("inf"))
    started = 0
    tasks: list[asyncio.Task] = []

    async def safe(user: int, number: int) -> None:
        try:
            await converse(args.url, user, number, args, rec, cache)
        except (OSError, websockets.WebSocketException) as exc:
            rec.errors[type(exc).__name__] += 1

    async def closed_loop_user(user: int) -> None:
        nonlocal started
        number = 0
        while started < conversations and time.monotonic() < deadline:
            started += 1
            await safe(user, number)
            number += 1

    async def progress() -> None:
        while True:
            print(rec.progress(), end="", file=sys.stderr, flush=True)
            await asyncio.sleep(1)

    reporter = asyncio.create_task(progress())
    try:
        async with asyncio.timeout(args.timeout):
            if args.rate:
                rng = random.Random(f"arrivals/{args.seed}")
                while started < conversations and time.monotonic() < deadline:
                    tasks.append(asyncio.create_task(safe(started, 0)))
                    started += 1
                    await asyncio.sleep(rng.expovariate(args.rate))
            else:
                tasks = [asyncio.create_task(closed_loop_user(u)) for u in range(args.users)]
            await asyncio.gather(*tasks)
    except TimeoutError:
        rec.errors["timeout"] += 1
        for t in tasks:
            t.cancel()
    finally:
        reporter.cancel()
        print(rec.progress(), file=sys.stderr)
    wall = time.monotonic() - rec.started
    return summarize(rec, wall)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(rec: Recorder, wall: float) -> dict:
    ok = [t for t in rec.turns if t.finish_reason]
    by_index: dict[int, list[float]] = defaultdict(list)
    for t in ok:
        if t.ttft_s is not None:
            by_index[t.index].append(t.ttft_s)
    return {
        "wall_s": wall,
        "turns": len(ok),
        "turns_started": len(rec.turns),
        "errors": dict(rec.errors),
        "output_tokens": sum(t.completion_tokens for t in ok),
        "output_tok_s": sum(t.completion_tokens for t in ok) / wall if wall else 0.0,
        "turns_per_s": len(ok) / wall if wall else 0.0,
        "prompt_tokens": sum(t.prompt_tokens for t in ok),
        "cached_tokens": sum(t.cached_tokens for t in ok),
        "tier_cached_tokens": sum(t.tier_cached_tokens for t in ok),
        "ttft_s": percentiles([t.ttft_s for t in ok if t.ttft_s is not None]),
        "itl_s": percentiles([g for t in ok for g in t.itl_s]),
        "frame_gap_s": percentiles([g for t in ok for g in t.frame_gap_s]),
        "e2e_s": percentiles([t.e2e_s for t in ok if t.e2e_s is not None]),
        "ttft_p50_by_turn": {i: statistics.median(v) for i, v in sorted(by_index.items())},
        "records": [asdict(t) for t in rec.turns],
    }


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:8.0f}"


def report(name: str, s: dict) -> None:
    print(f"\n== {name}: {s['turns']} turns in {s['wall_s']:.1f} s, "
          f"{s['output_tok_s']:.1f} output tok/s, {s['turns_per_s']:.2f} turns/s, "
          f"errors {s['errors'] or 'none'}")  # fmt: skip
    reused = s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0
    print(f"   prompt tokens {s['prompt_tokens']}, reused from cache {s['cached_tokens']} "
          f"({reused:.0%})")  # fmt: skip
    print("   latency (ms)      p50      p90      p99")
    rows = [("ttft_s", "TTFT"), ("itl_s", "inter-token"), ("e2e_s", "end-to-end")]
    if s["frame_gap_s"] != s["itl_s"]:  # frames of several tokens: how often one comes
        rows.insert(2, ("frame_gap_s", "inter-frame"))
    for key, label in rows:
        p = s[key]
        print(f"   {label:12s} {ms(p['p50'])} {ms(p['p90'])} {ms(p['p99'])}")
    print("   TTFT p50 by turn: " + ", ".join(
        f"{i}: {v * 1000:.0f} ms" for i, v in s["ttft_p50_by_turn"].items()))  # fmt: skip


def compare(reuse: dict, plain: dict) -> dict:
    last = max(reuse["ttft_p50_by_turn"], default=None)
    first = min(reuse["ttft_p50_by_turn"], default=None)
    out = {
        "total_time_ratio": reuse["wall_s"] / plain["wall_s"],
        "output_tok_s_ratio": reuse["output_tok_s"] / plain["output_tok_s"],
    }
    if last is not None and last in plain["ttft_p50_by_turn"]:
        out["last_turn"] = last
        out["last_turn_ttft_reuse_over_first"] = (
            reuse["ttft_p50_by_turn"][last] / reuse["ttft_p50_by_turn"][first]
        )
        out["last_turn_ttft_speedup"] = (
            plain["ttft_p50_by_turn"][last] / reuse["ttft_p50_by_turn"][last]
        )
    print("\n== reuse vs no reuse")
    print("   turn   TTFT p50 reuse   TTFT p50 no reuse   ratio")
    for i, v in reuse["ttft_p50_by_turn"].items():
        w = plain["ttft_p50_by_turn"].get(i)
        if w:
            print(f"   {i:4d}   {v * 1000:10.0f} ms   {w * 1000:13.0f} ms   {w / v:6.2f}x")
    print(f"   total time: {reuse['wall_s']:.1f} s vs {plain['wall_s']:.1f} s "
          f"({out['total_time_ratio']:.2f}x); output tok/s {reuse['output_tok_s']:.1f} vs "
          f"{plain['output_tok_s']:.1f}")  # fmt: skip
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, s in results.items():
        turns = list(s["ttft_p50_by_turn"])
        left.plot(turns, [s["ttft_p50_by_turn"][i] * 1000 for i in turns], "o-", label=name)
        e2e = sorted(r["e2e_s"] for r in s["records"] if r["e2e_s"] is not None)
        right.plot(e2e, [(i + 1) / len(e2e) for i in range(len(e2e))], label=name)
    left.set(xlabel="turn", ylabel="TTFT p50 (ms)", title="Time to first token by turn")
    right.set(xlabel="end-to-end latency (s)", ylabel="fraction of turns", title="Latency CDF")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def soak(args) -> dict:
    """Mixed traffic with cancels and disconnects, then the server must be clean."""
    rec = Recorder()
    http = args.url.replace("ws://", "http://").replace("wss://", "https://").rsplit("/ws", 1)[0]
    deadline = rec.started + args.duration
    created: list[str] = []
    counts: Counter[str] = Counter()
    rss: list[tuple[float, float]] = []

    async def user(u: int) -> None:
        rng = random.Random(f"soak/{args.seed}/{u}")
        number = 0
        while time.monotonic() < deadline:
            conversation = f"soak-{args.seed}-{u}-{number}"
            number += 1
            created.append(conversation)
            try:
                await soak_conversation(conversation, rng)
            except (OSError, websockets.WebSocketException) as exc:
                rec.errors[type(exc).__name__] += 1

    async def soak_conversation(conversation: str, rng: random.Random) -> None:
        messages: list[dict[str, str]] = []
        async with websockets.connect(
            args.url, max_size=None, additional_headers=args.headers
        ) as ws:
            for index in range(1, rng.randint(1, args.turns) + 1):
                messages.append(
                    {
                        "role": "user",
                        "content": user_message(
                            args.seed, hash(conversation) % 1000, 0, index, args.paste_probability
                        ),
                    }
                )
                turn = Turn(0, conversation, index, time.monotonic())
                rec.turns.append(turn)
                await ws.send(json.dumps({
                    "type": "chat", "id": f"t{index}", "conversation_id": conversation,
                    "messages": messages,
                    "params": {"temperature": 0.8, "max_tokens": rng.randint(4, args.max_tokens),
                               "seed": rng.randrange(1000)},
                }))  # fmt: skip
                action = rng.random()
                if action < args.cancel_probability:
                    counts["cancels"] += 1
                    asyncio.get_running_loop().call_later(
                        rng.uniform(0, 0.5), lambda i=index: asyncio.ensure_future(cancel(ws, i))
                    )
                drop = args.cancel_probability <= action
                drop = drop and action < args.cancel_probability + args.disconnect_probability
                try:
                    # A dropped connection: stop listening after a random moment, mid-reply.
                    async with asyncio.timeout(rng.uniform(0, 0.5) if drop else 300):
                        reply = await receive_turn(ws, turn, rec, f"t{index}")
                except TimeoutError:
                    if not drop:
                        turn.error = "turn timed out"
                        rec.errors[turn.error] += 1
                        return
                    counts["disconnects"] += 1
                    turn.error = "disconnected by the client"
                    return  # leaving the block closes the socket mid-reply
                if turn.error:
                    return
                messages.append({"role": "assistant", "content": reply})

    async def cancel(ws, index: int) -> None:
        # A cancel that comes after the reply ended gets "unknown_id" for that old turn,
        # which receive_turn ignores (it only reads the current turn's frames).
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.send(json.dumps({"type": "cancel", "id": f"t{index}"}))

    async def sample_rss() -> None:
        async with httpx_client() as client:
            while True:
                rss.append((time.monotonic() - rec.started, await resident_mib(client, http)))
                await asyncio.sleep(2)

    sampler = asyncio.create_task(sample_rss())
    reporter = asyncio.create_task(report_progress(rec))
    try:
        async with asyncio.timeout(args.duration + min(args.timeout, 600)):
            await asyncio.gather(*(user(u) for u in range(args.users)))
    finally:
        reporter.cancel()
        print(rec.progress(), file=sys.stderr)
    # Forget every conversation, then the server must hold nothing.
    async with websockets.connect(args.url, additional_headers=args.headers) as ws:
        for conversation in created:
            await ws.send(json.dumps({"type": "delete", "conversation_id": conversation}))
            await asyncio.wait_for(ws.recv(), 10)
    async with httpx_client() as client:
        clean = None
        for _ in range(100):
            m = await scrape(client, http)
            clean = {
                "num_requests_running": m.get("parley:num_requests_running"),
                "num_requests_waiting": m.get("parley:num_requests_waiting"),
                "kv_cache_usage_perc": m.get("parley:kv_cache_usage_perc"),
                "sessions_pinned": m.get("parley:sessions_pinned"),
            }
            if not any(clean.values()):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.5)
        sampler.cancel()
        rss.append((time.monotonic() - rec.started, await resident_mib(client, http)))
    warm = [v for t, v in rss if t >= 0.2 * args.duration] or [v for _, v in rss]
    growth = rss[-1][1] / warm[0] - 1
    unexpected = {k: v for k, v in rec.errors.items() if v}
    result = summarize(rec, time.monotonic() - rec.started)
    result["soak"] = {
        "duration_s": args.duration,
        "conversations": len(created),
        **counts,
        "unexpected_errors": unexpected,
        "server_after": clean,
        "rss_mib": rss,
        "rss_after_warmup_mib": warm[0],
        "rss_growth": growth,
        "passed": not unexpected and not any((clean or {}).values()) and growth <= 0.05,
    }
    return result


def client_headers(url: str, api_key: str | None) -> dict[str, str]:
    """What every connection of this run sends: the API key, or else the client cookie
    that the page hands a browser. A conversation belongs to the client that started it,
    so the whole run acts as one client (one browser with many tabs)."""
    import httpx

    if api_key:
        return {"Authorization": f"Bearer {api_key}"}
    http = url.replace("ws://", "http://").replace("wss://", "https://").rsplit("/ws", 1)[0]
    page = httpx.get(http + "/", timeout=30)
    return {"Cookie": "; ".join(f"{k}={v}" for k, v in page.cookies.items())}


def public(args) -> dict:
    """The run's settings, for the results file: no credentials."""
    return {k: v for k, v in vars(args).items() if k not in ("headers", "api_key")}


def httpx_client():
    import httpx

    return httpx.AsyncClient(timeout=10)


async def scrape(client, http: str) -> dict[str, float]:
    text = (await client.get(http + "/metrics")).text
    values = {}
    for line in text.splitlines():  # name or name{labels}, then the value
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def resident_mib(client, http: str) -> float:
    """The server's resident memory, less the K/V pool's written part and what its KV tier
    holds in memory: both fill up to their size by design (the pool's pages become
    resident as blocks are first used; the tier keeps evicted K/V for later), which is
    not a leak."""
    metrics = await scrape(client, http)
    rss = metrics.get("process_resident_memory_bytes", 0.0)
    rss -= metrics.get("parley:kv_cache_resident_bytes", 0.0)
    if any(k.startswith('parley:kv_tier_info{backend="memory') for k in metrics):
        rss -= metrics.get("parley:kv_tier_bytes", 0.0)
    return rss / 2**20


async def report_progress(rec: Recorder) -> None:
    while True:
        print(rec.progress(), end="", file=sys.stderr, flush=True)
        await asyncio.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000/ws")
    ap.add_argument("--api-key", default=None, help="the server's API key, if it wants one")
    ap.add_argument("--users", type=int, default=8, help="closed loop: simultaneous users")
    ap.add_argument("--rate", type=float, default=0.0, help="open loop: conversations/s")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--think", type=float, default=0.0, help="mean think time (s)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--paste-probability", type=float, default=0.25)
    ap.add_argument("--duration", type=float, default=0.0, help="stop starting after (s)")
    ap.add_argument("--conversations", type=int, default=0, help="stop after this many")
    ap.add_argument("--timeout", type=float, default=3600.0, help="hard stop (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-no-reuse", action="store_true")
    ap.add_argument("--soak", action="store_true", help="mixed traffic, then check the server")
    ap.add_argument("--cancel-probability", type=float, default=0.15)
    ap.add_argument("--disconnect-probability", type=float, default=0.1)
    ap.add_argument("--out", default="bench/results/ws_load.json")
    ap.add_argument("--plot", nargs="?", const="bench/results/ws_load.png", default=None)
    args = ap.parse_args()
    args.headers = client_headers(args.url, args.api_key)

    if args.soak:
        if not args.duration:
            ap.error("--soak needs --duration")
        result = asyncio.run(soak(args))
        report("soak", result)
        s = result["soak"]
        print(f"   {s['conversations']} conversations, {s.get('cancels', 0)} cancels, "
              f"{s.get('disconnects', 0)} disconnects; unexpected errors: "
              f"{s['unexpected_errors'] or 'none'}")  # fmt: skip
        print(f"   server afterwards: {s['server_after']}")
        print(f"   RSS after warm-up {s['rss_after_warmup_mib']:.0f} MiB, at the end "
              f"{s['rss_mib'][-1][1]:.0f} MiB ({s['rss_growth']:+.1%})")  # fmt: skip
        print("   PASSED" if s["passed"] else "   FAILED")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": public(args), "runs": {"soak": result}},
                                             indent=1))  # fmt: skip
        sys.exit(0 if s["passed"] else 1)

    results = {"reuse": asyncio.run(run(args, cache=True))}
    report("with reuse", results["reuse"])
    summary: dict = {"config": public(args), "runs": results}
    if args.compare_no_reuse:
        results["no_reuse"] = asyncio.run(run(args, cache=False))
        report("without reuse", results["no_reuse"])
        summary["comparison"] = compare(results["reuse"], results["no_reuse"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {args.out}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
