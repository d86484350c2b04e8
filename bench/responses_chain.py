"""A conversation through the Responses API, two ways, on the default model: each turn a
follow-up by `previous_response_id` (the stored response's pinned conversation), against
the same turns sent stateless (`store: false`, the whole history resent each time, found
in the prefix cache block by block). Prints the prompt tokens each turn computed (input
less cached) and the time to the reply, and their ratios.

    python bench/responses_chain.py            # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.model.loader import load_model
from app.server.app import create_app
from tests.e2e.live_server import live_server

TURNS = [
    "Name a fruit.",
    "What colour is it?",
    "Where does it grow?",
    "Name another fruit.",
    "Which of the two is sweeter?",
    "Give me a recipe with both.",
    "How long does it take?",
    "Thanks. Summarise our chat.",
]


def run(model, chained: bool, max_tokens: int) -> list[dict]:
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(256 << 20)), model))
    rows = []
    with live_server(create_app(engine=engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        previous, history = None, []
        for text in TURNS:
            start = time.perf_counter()
            if chained:
                out = client.responses.create(
                    input=text,
                    previous_response_id=previous,
                    temperature=0,
                    max_output_tokens=max_tokens,
                )
                previous = out.id
            else:
                history.append({"role": "user", "content": text})
                out = client.responses.create(
                    input=history, store=False, temperature=0, max_output_tokens=max_tokens
                )
                history.append({"role": "assistant", "content": out.output_text})
            seconds = time.perf_counter() - start
            u = out.usage
            rows.append(
                {
                    "input": u.input_tokens,
                    "cached": u.input_tokens_details.cached_tokens,
                    "computed": u.input_tokens - u.input_tokens_details.cached_tokens,
                    "output": u.output_tokens,
                    "seconds": seconds,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/responses_chain.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(ModelConfig())
    run(model, True, 4)  # warm up
    chain = run(model, True, args.max_tokens)
    resend = run(model, False, args.max_tokens)
    print("turn | chained: input cached computed s | resent: input cached computed s")
    for i, (a, b) in enumerate(zip(chain, resend), 1):
        print(
            f"{i} | {a['input']} {a['cached']} {a['computed']} {a['seconds']:.2f} | "
            f"{b['input']} {b['cached']} {b['computed']} {b['seconds']:.2f}"
        )
    later = slice(1, None)  # the follow-ups
    computed = sum(r["computed"] for r in resend[later]) / sum(r["computed"] for r in chain[later])
    seconds = sum(r["seconds"] for r in resend[later]) / sum(r["seconds"] for r in chain[later])
    print(
        f"follow-ups: resent computes {computed:.2f}x the prompt tokens, takes {seconds:.2f}x "
        "the time"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"chained": chain, "resent": resend, "computed_ratio": computed, "time_ratio": seconds},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
