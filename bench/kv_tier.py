"""KV tier: conversations that outgrow the KV cache, with the tier off, in host memory and
in Redis on loopback, against a cache big enough for everything; and one long history
restored from each tier against recomputing it.

    python bench/kv_tier.py                                   # both parts
    python bench/kv_tier.py --part restore                    # restore vs recompute only
    python bench/kv_tier.py --part workload --users 24        # a smaller workload
    python bench/kv_tier.py --part workload --pairs memory:big,redis:big,memory:off
    python bench/kv_tier.py --part workload --pairs memory:off \
        --server-flags "--quantization none --dtype float32"   # the fp32 reference

Workload: bench/ws_load.py's simulated users over /ws (closed loop, one conversation
each), every turn after the first a 150-300 word paste, greedy replies of --max-tokens
tokens with ignore_eos, exponential think time: histories grow to ~2,000 tokens by turn 6.
Each configuration gets a fresh server process (`python -m app`) on this machine:

    big            --kv-cache-size big enough for every conversation, tier none
    off            --kv-cache-size small, tier none: lost pins mean recompute
    memory         small cache, --kv-tier memory:SIZE
    redis          small cache, --kv-tier redis://127.0.0.1:PORT/0 (a redis-server this
                   script starts: no persistence, maxmemory with allkeys-lru)
    memory-evict   as memory, --kv-tier-store evict (blocks stored only when reused)
    big-memory     as big, with the memory tier: what storing costs when nothing is lost
                   (not in the default --configs)

With --pairs, two configurations run side by side (a server each, half the threads,
the same workload against each), so that whatever else runs on a shared machine slows
both alike; one after the other, a noisy neighbour can swing a run by 2-3x. It reports
TTFT p50 of turns 2-6 and total time against `big` and `off`, the tokens each
took from the pool, pins and the tier, the tier's counters from /metrics, and whether
every reply is identical to `off`'s. Restore: a --history-token prompt is computed, stored
in the tier, dropped from the pool (its memory reused) and asked again; time to first
token against recomputing it, best of --repeats. Writes bench/results/kv_tier.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ws_load  # bench/ws_load.py: the simulated users
from servers import free_port, start, stop

CONFIGS = ("big", "off", "memory", "redis", "memory-evict")


@contextlib.contextmanager
def redis_server(maxmemory: str):
    """A throwaway redis-server on a free loopback port."""
    port = free_port()
    folder = tempfile.mkdtemp(prefix="parley-bench-redis-")
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", "--dir", folder, "--maxmemory", maxmemory,
           "--maxmemory-policy", "allkeys-lru"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


# -- part 1: restore one long history vs recompute it ---------------------------------------


def history_ids(tokenizer, n: int) -> list[int]:
    words = " ".join(ws_load.WORDS[i * 7 % len(ws_load.WORDS)] for i in range(2 * n))
    return tokenizer.encode(words, add_special_tokens=False)[:n]


def ttft(engine, prompt: list[int], rid: str, use_prefix_cache: bool = True):
    from app.engine.engine_request import EngineRequest
    from app.engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    req = engine.make_request(EngineRequest(prompt, params, rid, use_prefix_cache=use_prefix_cache))
    engine.add(req)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    return last.timings.first_token - req.timings.arrival, last


def restore_vs_recompute(engine, prompt: list[int], repeats: int) -> dict:
    """Time to first token of `prompt` recomputed, and restored from the engine's tier
    after the pool forgot it; the two alternate (this machine is shared and noisy), after
    one warm-up each, and each side keeps its best."""
    ttft(engine, prompt, "store")  # computed once: the tier has it
    assert engine.offload.flush(300)
    recompute, restore, pool_hit = [], [], []
    for i in range(repeats + 1):
        recompute.append(ttft(engine, prompt, f"r{i}", use_prefix_cache=False)[0])
        pool = engine.kv.pool
        pool.free(pool.allocate(pool.num_free_blocks))  # the pool forgets it: reused memory
        before = engine.offload.stats()
        seconds, out = ttft(engine, prompt, f"t{i}")
        after = engine.offload.stats()
        assert out.tier_cached_tokens == (len(prompt) - 1) // 16 * 16, out
        load = after.load_seconds.total - before.load_seconds.total
        restore.append((seconds, load, after.copy_seconds.total - before.copy_seconds.total))
        seconds, out = ttft(engine, prompt, f"p{i}")  # still in the pool: a big pool's case
        assert out.tier_cached_tokens == 0 and out.cached_tokens > 0, out
        pool_hit.append(seconds)
    # The first of each warms kernels up.
    recompute, restore, pool_hit = recompute[1:], restore[1:], pool_hit[1:]
    best = min(restore)
    blocks = (len(prompt) - 1) // 16
    return {
        "recompute_ttft_s": min(recompute),
        "recompute_all_s": recompute,
        "pool_hit_ttft_s": min(pool_hit),
        "pool_hit_all_s": pool_hit,
        "restore_ttft_s": best[0],
        "restore_all_s": [r[0] for r in restore],
        "speedup": min(recompute) / best[0],
        "restore_vs_pool_hit": best[0] / min(pool_hit),
        "load_s": best[1],  # fetch + check + unpack, on the loader thread
        "copy_s": best[2],  # into the cache, on the engine thread
        "kv_mb": engine.offload.layout.payload_bytes * blocks / 1e6,
    }


def restore_part(args) -> dict:
    import torch

    from app.config import CacheConfig, EngineConfig, ModelConfig, TierConfig
    from app.engine.engine import LLMEngine
    from app.model.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig())
    prompt = history_ids(loaded.tokenizer, args.history_tokens)
    results: dict = {"history_tokens": len(prompt)}
    folder = tempfile.mkdtemp(prefix="parley-bench-disk-")
    with redis_server("4gb") as url:
        tiers = {"memory": TierConfig("memory"), "redis": TierConfig("redis", url),
                 "disk": TierConfig("disk", folder)}  # fmt: skip
        for name, tier in tiers.items():
            config = EngineConfig(cache=CacheConfig(256 << 20), tier=tier)
            engine = LLMEngine(config, loaded)
            try:
                results[name] = restore_vs_recompute(engine, prompt, args.repeats)
            finally:
                engine.close()
            r = results[name]
            print(f"{name:7s} recompute {r['recompute_ttft_s']:.2f} s, restore "
                  f"{r['restore_ttft_s'] * 1000:.0f} ms (load {r['load_s'] * 1000:.0f} ms, copy "
                  f"{r['copy_s'] * 1000:.0f} ms): {r['speedup']:.1f}x faster for "
                  f"{r['kv_mb']:.0f} MB; a pool hit {r['pool_hit_ttft_s'] * 1000:.0f} ms "
                  f"(restore {r['restore_vs_pool_hit']:.2f}x)", flush=True)  # fmt: skip
        kv_bytes = int(results["memory"]["kv_mb"] * 1e6)
        results["redis_granularity"] = granularity(url, kv_bytes)
    shutil.rmtree(folder, ignore_errors=True)
    return results


def granularity(url: str, kv_bytes: int, block: int = 737_280) -> dict:
    """Redis: one entry per block against one per run of 8 blocks and one per history,
    same bytes, best of 3 (what the entry layout should be)."""
    import os

    import redis

    client = redis.Redis.from_url(url, socket_read_size=1 << 20)
    out = {}
    for per_entry in (1, 8, kv_bytes // block):
        n = max(1, kv_bytes // (block * per_entry))
        value = os.urandom(block * per_entry)
        keys = [f"bench:{per_entry}:{i}" for i in range(n)]
        put = get = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.set(k, value)
            pipe.execute()
            put = min(put, time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.mget(keys)
            get = min(get, time.perf_counter() - t0)
        client.delete(*keys)
        out[f"{per_entry} blocks/entry"] = {"entries": n, "put_s": put, "get_s": get}
        print(f"redis, {per_entry:3d} blocks an entry ({n} entries): put {put * 1000:.0f} ms, "
              f"get {get * 1000:.0f} ms", flush=True)  # fmt: skip
    return out


# -- part 2: the workload -------------------------------------------------------------------


def flags_for(name: str, args, redis_url: str | None) -> list[str]:
    small = ["--kv-cache-size", args.small_cache]
    return {
        "big": ["--kv-cache-size", args.big_cache, "--kv-tier", "none"],
        "off": [*small, "--kv-tier", "none"],
        "memory": [*small, "--kv-tier", f"memory:{args.tier_size}"],
        "redis": [*small, "--kv-tier", redis_url or "none"],
        "memory-evict": [*small, "--kv-tier", f"memory:{args.tier_size}",
                         "--kv-tier-store", "evict"],
        "big-memory": ["--kv-cache-size", args.big_cache, "--kv-tier",
                       f"memory:{args.tier_size}"],
    }[name]  # fmt: skip


@contextlib.contextmanager
def server(flags: list[str], args, threads: int | None = None):
    threads = threads or args.threads
    proc, url = start(["--threads", str(threads), "--max-num-seqs", str(args.max_num_seqs),
                       *args.server_flags.split(), *flags])  # fmt: skip
    try:
        yield url
    finally:
        stop(proc)


def scrape(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("parley:") and " " in line:
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def workload_args(args, url: str) -> argparse.Namespace:
    ns = argparse.Namespace(
        url=url.replace("http", "ws") + "/ws", users=args.users, rate=0.0, turns=args.turns,
        think=args.think, max_tokens=args.max_tokens, ignore_eos=True, paste_probability=1.0,
        duration=0.0, conversations=args.users, timeout=args.timeout, seed=args.seed,
    )  # fmt: skip
    ns.headers = ws_load.client_headers(ns.url, None)
    return ns


def run_config(name: str, args, redis_url: str | None) -> dict:
    print(f"\n== {name}: {' '.join(flags_for(name, args, redis_url))}", flush=True)
    with server(flags_for(name, args, redis_url), args) as url:
        result = asyncio.run(ws_load.run(workload_args(args, url), cache=True))
        time.sleep(1.5)  # the engine's stats snapshot after its last step
        result["metrics"] = scrape(url)
    return finish(name, result)


def run_pair(a: str, b: str, args, redis_url: str | None) -> tuple[dict, dict]:
    """Two configurations at once, a server each with half the threads, the same
    workload against each: whatever else the machine runs slows both alike."""
    half = max(1, args.threads // 2)
    print(f"\n== {a} and {b} side by side, {half} thread(s) each", flush=True)
    with (
        server(flags_for(a, args, redis_url), args, half) as url_a,
        server(flags_for(b, args, redis_url), args, half) as url_b,
    ):

        async def both() -> list[dict]:
            runs = (ws_load.run(workload_args(args, u), cache=True) for u in (url_a, url_b))
            return await asyncio.gather(*runs)

        result_a, result_b = asyncio.run(both())
        time.sleep(1.5)
        result_a["metrics"], result_b["metrics"] = scrape(url_a), scrape(url_b)
    return finish(a, result_a), finish(b, result_b)


def finish(name: str, result: dict) -> dict:
    later = [r for r in result["records"] if r["index"] >= 2 and r["ttft_s"] is not None]
    result["ttft_p50_turns_2_6"] = statistics.median(r["ttft_s"] for r in later)
    ws_load.report(name, result)
    m = result["metrics"]
    pressure = m.get('parley:session_unpins_total{reason="pressure"}', 0)
    print(f"   tier-cached tokens {result['tier_cached_tokens']}; tier hits "
          f"{m.get('parley:kv_tier_hits_total', 0):.0f} blocks, stores "
          f"{m.get('parley:kv_tier_stores_total', 0):.0f}, dropped "
          f"{m.get('parley:kv_tier_stores_dropped_total', 0):.0f}; pins lost to pressure "
          f"{pressure:.0f}; preemptions "
          f"{m.get('parley:num_preemptions_total', 0):.0f}", flush=True)  # fmt: skip
    return result


def replies(result: dict) -> dict[tuple[str, int], str]:
    return {(r["conversation"], r["index"]): r["reply"] for r in result["records"]}


def compare_pairs(pairs: list[tuple[str, str, dict, dict]]) -> list[dict]:
    out = []
    print("\n== side by side (first / second)")
    for a, b, ra, rb in pairs:
        row = {
            "pair": f"{a} / {b}",
            "ttft_p50_turns_2_6_s": [ra["ttft_p50_turns_2_6"], rb["ttft_p50_turns_2_6"]],
            "ttft_ratio": ra["ttft_p50_turns_2_6"] / rb["ttft_p50_turns_2_6"],
            "wall_s": [ra["wall_s"], rb["wall_s"]],
            "wall_ratio": ra["wall_s"] / rb["wall_s"],
            "replies_identical": replies(ra) == replies(rb),
            "replies_differing": sum(
                reply != replies(rb).get(key) for key, reply in replies(ra).items()
            ),
        }
        out.append(row)
        print(f"   {row['pair']:16s} TTFT p50 turns 2-6 {ra['ttft_p50_turns_2_6'] * 1000:6.0f} / "
              f"{rb['ttft_p50_turns_2_6'] * 1000:6.0f} ms = {row['ttft_ratio']:.2f}x   total "
              f"{ra['wall_s']:6.1f} / {rb['wall_s']:6.1f} s = {row['wall_ratio']:.2f}x   "
              f"replies identical: {row['replies_identical']} "
              f"({row['replies_differing']} of {len(ra['records'])} differ)",
              flush=True)  # fmt: skip
    return out


def compare(results: dict) -> dict:
    big, off = results.get("big"), results.get("off")
    out = {}
    print("\n== summary (TTFT p50 of turns 2-6, total time)")
    for name, r in results.items():
        row = {"ttft_p50_turns_2_6_s": r["ttft_p50_turns_2_6"], "wall_s": r["wall_s"],
               "errors": r["errors"]}  # fmt: skip
        if big:
            row["ttft_vs_big"] = r["ttft_p50_turns_2_6"] / big["ttft_p50_turns_2_6"]
        if off:
            row["wall_vs_off"] = r["wall_s"] / off["wall_s"]
            same = replies(r) == replies(off)
            diff = sum(replies(r).get(k) != v for k, v in replies(off).items())
            row["replies_identical_to_off"] = same
            row["replies_differing"] = diff
        out[name] = row
        print(f"   {name:13s} TTFT {r['ttft_p50_turns_2_6'] * 1000:7.0f} ms"
              + (f" ({row['ttft_vs_big']:.2f}x big)" if big else "")
              + f"   total {r['wall_s']:7.1f} s"
              + (f" ({row['wall_vs_off']:.2f}x off)" if off else "")
              + (f"   replies = off: {row['replies_identical_to_off']}"
                 f" ({row['replies_differing']} differ)" if off else ""),
              flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "restore", "workload"), default="all")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument(
        "--pairs",
        default="",
        help="instead of --configs: A:B,C:D runs A and B side by side (then C and D)",
    )
    ap.add_argument("--users", type=int, default=48)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--think", type=float, default=5.0, help="mean think time (s)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--small-cache", default="640MiB", help="the pool that is outgrown")
    ap.add_argument("--max-num-seqs", type=int, default=12, help="the batch: it fits the pool")
    ap.add_argument("--big-cache", default="6GiB", help="a pool that holds everything")
    ap.add_argument("--tier-size", default="6GiB", help="the memory tier's budget")
    ap.add_argument("--redis-maxmemory", default="6gb")
    ap.add_argument("--history-tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-flags", default="", help="more flags for each server (fp32: "
                    '"--quantization none --dtype float32")')  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=7200.0)
    ap.add_argument("--out", default="bench/results/kv_tier.json")
    args = ap.parse_args()
    summary: dict = {"config": vars(args), "machine": platform.platform()}
    if args.part in ("all", "restore"):
        print("== restore a history vs recompute it (time to first token)", flush=True)
        summary["restore"] = restore_part(args)
    if args.part in ("all", "workload"):
        results: dict = {}
        with redis_server(args.redis_maxmemory) as url:
            if args.pairs:
                pairs = []
                for pair in args.pairs.split(","):
                    a, b = pair.split(":")
                    result_a, result_b = run_pair(a, b, args, url)
                    pairs.append((a, b, result_a, result_b))
                    results[f"{a} (beside {b})"] = result_a
                    results[f"{b} (beside {a})"] = result_b
                summary["workload"] = {"runs": results, "pairs": compare_pairs(pairs)}
            else:
                for name in args.configs.split(","):  # a name given twice runs twice
                    key = name if name not in results else f"{name}#{len(results)}"
                    results[key] = run_config(name, args, url)
                summary["workload"] = {"runs": results, "comparison": compare(results)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
