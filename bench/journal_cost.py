"""What the turn journal costs: the same /ws load with and without `--journal`.

    python bench/journal_cost.py                    # 32 streams, 3 rounds of each, ~3 minutes
    python bench/journal_cost.py --streams 8 --rounds 1 --max-tokens 32   # a quick look

One process loads the default model once; each run builds a fresh engine and app (with a
journal on a redis-server this script starts on a free port with AOF, or `--redis-url`),
serves it with uvicorn on a free port and drives it with ws_load.py's client: --streams
users, one greedy turn each of --max-tokens tokens (`ignore_eos`), all at once. After one
warm-up run the arms alternate, the order flipping every round (plain-journal,
journal-plain, ...), so that the noise of a shared machine falls on both; each round's
journal / plain ratio is taken and their median reported, beside each arm's median.
Prints aggregate output tok/s, the inter-token gaps each arm saw, and the journal's own
figures (frames recorded, round trips, mean round trip) from /metrics. Writes
bench/results/journal_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ws_load
from servers import free_port

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.model.loader import load_model
from app.server.app import ServerConfig, create_app
from app.server.journal import JournalConfig


def start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "yes", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def serve(app) -> tuple[uvicorn.Server, threading.Thread, int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, port


def one_run(model, args, journal_url: str | None, run_number: int) -> dict:
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(args.kv_cache_size)), model))
    journal = JournalConfig(journal_url, consumer=f"bench-{run_number}") if journal_url else None
    app = create_app(engine=engine, server_config=ServerConfig(journal=journal))
    server, thread, port = serve(app)
    try:
        client = argparse.Namespace(
            url=f"ws://127.0.0.1:{port}/ws", users=args.streams, rate=0.0, turns=1, think=0.0,
            max_tokens=args.max_tokens, ignore_eos=True, paste_probability=0.0, duration=0.0,
            conversations=args.streams, timeout=600.0, seed=run_number,
        )  # fmt: skip
        client.headers = ws_load.client_headers(client.url, None)
        result = asyncio.run(ws_load.run(client, cache=True))
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        server.should_exit = True
        thread.join(60)
    values = {}
    for line in metrics.splitlines():
        if line.startswith("parley:journal_"):
            name, value = line.split()
            values[name] = float(value)
    return {
        "output_tok_s": result["output_tok_s"],
        "itl_p50_s": result["itl_s"]["p50"],
        "itl_p90_s": result["itl_s"]["p90"],
        "ttft_p50_s": result["ttft_s"]["p50"],
        "turns": result["turns"],
        "errors": result["errors"],
        "journal": values,
    }


async def frame_cost(url: str, streams: int, frames: int = 200) -> dict:
    """The journal alone: `streams` turns recording `frames` token frames each, as fast
    as Redis takes them. The CPU this process spends per frame is the journal's own cost
    on the event loop (the model's work is what it competes with)."""
    from app.chat.prompt import Message
    from app.engine.request import SamplingParams
    from app.server.journal import Journal
    from app.server.journal_records import TurnRecord

    journal = Journal(JournalConfig(url, consumer="bench-frames"))
    await journal.open()
    record = TurnRecord("", "bench", "c", "t", [Message("user", "hi")], SamplingParams(),
                        True, None, list(range(40)))  # fmt: skip
    entries = [await journal.accept(record, f"frames-{i}") for i in range(streams)]

    async def turn(entry) -> None:
        for seq in range(frames):
            await journal.progress(entry, seq, " word", [1234])

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(turn(e) for e in entries))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    for entry in entries:
        await journal.finish(entry, None, False, [])
    await journal.close()
    n = streams * frames
    return {"frames": n, "cpu_us_per_frame": 1e6 * cpu / n, "frames_per_s": n / wall}


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each arm")
    ap.add_argument("--kv-cache-size", type=int, default=512 << 20)
    ap.add_argument("--redis-url", default=None, help="default: start a redis-server here")
    ap.add_argument("--out", default="bench/results/journal_cost.json")
    args = ap.parse_args()

    model = load_model(ModelConfig())
    redis_process = None
    url = args.redis_url
    folder = tempfile.TemporaryDirectory()
    if url is None:
        redis_process, url = start_redis(Path(folder.name))
    try:
        cost = asyncio.run(frame_cost(url, args.streams))
        print(f"journal alone: {cost['cpu_us_per_frame']:.1f} us of CPU per frame, "
              f"{cost['frames_per_s']:.0f} frames/s", file=sys.stderr)  # fmt: skip
        print("warm-up run (not counted)", file=sys.stderr)
        one_run(model, args, None, 0)
        runs: dict[str, list[dict]] = {"plain": [], "journal": []}
        for r in range(args.rounds):
            for arm in ("plain", "journal") if r % 2 == 0 else ("journal", "plain"):
                result = one_run(model, args, url if arm == "journal" else None, 1 + 2 * r)
                runs[arm].append(result)
                print(f"\n{arm:8s} {result['output_tok_s']:7.1f} tok/s  inter-token p50 "
                      f"{result['itl_p50_s'] * 1000:6.1f} ms  errors {result['errors'] or 0}",
                      file=sys.stderr)  # fmt: skip
    finally:
        if redis_process is not None:
            redis_process.terminate()
            redis_process.wait(10)
        folder.cleanup()

    plain, journal = runs["plain"], runs["journal"]
    summary = {
        "plain_tok_s": median(plain, "output_tok_s"),
        "journal_tok_s": median(journal, "output_tok_s"),
        "plain_itl_p50_ms": median(plain, "itl_p50_s") * 1000,
        "journal_itl_p50_ms": median(journal, "itl_p50_s") * 1000,
        "plain_itl_p90_ms": median(plain, "itl_p90_s") * 1000,
        "journal_itl_p90_ms": median(journal, "itl_p90_s") * 1000,
    }
    # Each round's two runs ran back to back: their ratio is what the journal cost then.
    # The least disturbed run of each arm (foreign load only ever slows a run down).
    summary["best_tok_s_ratio"] = max(r["output_tok_s"] for r in journal) / max(
        r["output_tok_s"] for r in plain
    )
    summary["best_itl_p50_ratio"] = min(r["itl_p50_s"] for r in journal) / min(
        r["itl_p50_s"] for r in plain
    )
    summary["tok_s_ratio"] = statistics.median(
        j["output_tok_s"] / p["output_tok_s"] for p, j in zip(plain, journal)
    )
    summary["itl_p50_ratio"] = statistics.median(
        j["itl_p50_s"] / p["itl_p50_s"] for p, j in zip(plain, journal)
    )
    frames = sum(r["journal"].get("parley:journal_frames_total", 0) for r in journal)
    flushes = sum(r["journal"].get("parley:journal_flushes_total", 0) for r in journal)
    seconds = sum(r["journal"].get("parley:journal_flush_seconds_total", 0) for r in journal)
    summary["journal_alone"] = cost
    summary["frames_per_round_trip"] = frames / flushes if flushes else None
    summary["round_trip_ms"] = 1000 * seconds / flushes if flushes else None

    print(f"\n== {args.streams} streams x {args.max_tokens} tokens, {args.rounds} rounds: medians "
          f"of each arm, and of the rounds' journal / plain ratios")  # fmt: skip
    print(f"   output tok/s      {summary['plain_tok_s']:7.1f} plain, "
          f"{summary['journal_tok_s']:7.1f} journal: {summary['tok_s_ratio']:.3f}x "
          f"(target >= 0.95x)")  # fmt: skip
    print(f"   inter-token p50   {summary['plain_itl_p50_ms']:7.1f} ms plain, "
          f"{summary['journal_itl_p50_ms']:7.1f} ms journal: {summary['itl_p50_ratio']:.3f}x "
          f"(target <= 1.05x)")  # fmt: skip
    print(f"   best run of each: tok/s {summary['best_tok_s_ratio']:.3f}x, inter-token p50 "
          f"{summary['best_itl_p50_ratio']:.3f}x")  # fmt: skip
    print(f"   inter-token p90   {summary['plain_itl_p90_ms']:7.1f} ms plain, "
          f"{summary['journal_itl_p90_ms']:7.1f} ms journal")  # fmt: skip
    if flushes:
        print(f"   journal: {frames:.0f} frames recorded in {flushes:.0f} round trips "
              f"({summary['frames_per_round_trip']:.1f} frames each, "
              f"{summary['round_trip_ms']:.2f} ms each)")  # fmt: skip
    print(f"   journal alone: {cost['cpu_us_per_frame']:.1f} us of CPU per frame recorded "
          f"({cost['frames_per_s']:.0f} frames/s at most)")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "summary": summary, "runs": runs},
                                         indent=1))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
