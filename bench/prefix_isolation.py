"""The prefix cache as a timing side channel, with and without isolation.

    python bench/prefix_isolation.py                 # 8 rounds, a ~1000-token document
    python bench/prefix_isolation.py --rounds 3 --doc-words 300   # a quick look

One process loads the default model once; each arm (`--prefix-cache-isolation none`, then
`tenant`) gets a fresh engine and app with two tenants, served by uvicorn on a free port.
Each round the victim (alice) tells a new PIN followed by a long document; the guesser
(bob) then sends the same message with a wrong PIN and with the right one, in an order
that flips every round. A right guess without isolation finds the victim's whole prompt
in the prefix cache and answers at once; with isolation it computes everything, as a
wrong guess does. Prints, per arm, the median time of a right and of a wrong guess
(max_tokens 1: the prefill, mostly), their ratio, and the cached_tokens each saw. A
ratio near 1.0 means the guesser cannot tell; the ratio without isolation, measured in
the same run, is the baseline the channel is read from.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from servers import free_port

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.model.loader import load_model
from app.server.app import ServerConfig, create_app
from app.server.chat_service import ChatConfig

WORDS = ("rain", "tea", "walked", "the", "river", "slowly", "letters", "home", "quiet", "morning",
         "friend", "garden")  # fmt: skip
KEYS = {name: hashlib.sha256(f"{name}-key".encode()).digest() for name in ("alice", "bob")}


def serve(app) -> tuple[uvicorn.Server, threading.Thread, int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, port


def message(pin: str, document: str) -> list[dict]:
    return [{"role": "user", "content": f"My PIN is {pin}. Keep it. Here is my diary: {document}"}]


def ask(client: httpx.Client, url: str, tenant: str, messages: list[dict]) -> tuple[float, int]:
    """Seconds to the (one-token) answer, and its cached_tokens."""
    start = time.perf_counter()
    r = client.post(url + "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {tenant}-key"},
                    json={"messages": messages, "max_tokens": 1, "temperature": 0})  # fmt: skip
    took = time.perf_counter() - start
    r.raise_for_status()
    return took, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def arm(model, isolate: bool, args, rng: random.Random) -> dict:
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(args.kv_cache_size)), model))
    config = ServerConfig(api_keys=KEYS, chat=ChatConfig(isolate_prefix_cache=isolate))
    server, thread, port = serve(create_app(engine=engine, server_config=config))
    url = f"http://127.0.0.1:{port}"
    document = " ".join(rng.choice(WORDS) for _ in range(args.doc_words))
    right, wrong = [], []
    try:
        with httpx.Client(timeout=600) as client:
            ask(client, url, "bob", message("0000", document))  # warm-up: the arm's first prefill
            for i in range(args.rounds):
                pin = f"{rng.randrange(10_000):04d}"
                guess = f"{(int(pin) + 1 + rng.randrange(9_998)) % 10_000:04d}"
                ask(client, url, "alice", message(pin, document))
                order = [(pin, right), (guess, wrong)]
                for value, into in order if i % 2 == 0 else order[::-1]:
                    into.append(ask(client, url, "bob", message(value, document)))
    finally:
        server.should_exit = True
        thread.join(60)
    t_right = statistics.median(t for t, _ in right)
    t_wrong = statistics.median(t for t, _ in wrong)
    return {
        "isolation": "tenant" if isolate else "none",
        "right_s": t_right,
        "wrong_s": t_wrong,
        "right_over_wrong": t_right / t_wrong,
        "cached_right": sorted({c for _, c in right}),
        "cached_wrong": sorted({c for _, c in wrong}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--doc-words", type=int, default=700, help="~1.4 tokens a word")
    ap.add_argument("--kv-cache-size", type=int, default=256 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/prefix_isolation.json")
    args = ap.parse_args()
    model = load_model(ModelConfig())
    results = [arm(model, isolate, args, random.Random(args.seed)) for isolate in (False, True)]
    for r in results:
        print(f"isolation {r['isolation']:>6}: right guess {r['right_s'] * 1000:7.0f} ms, "
              f"wrong {r['wrong_s'] * 1000:7.0f} ms, right/wrong {r['right_over_wrong']:.2f}; "
              f"cached_tokens right {r['cached_right']} wrong {r['cached_wrong']}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "arms": results}, indent=2))


if __name__ == "__main__":
    main()
