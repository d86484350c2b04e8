"""What the server path costs one conversation: the decode rate of one request in the
engine alone against the same request streamed over /v1 (SSE) and over /ws, on the same
build and flags.

    python bench/server_path.py                      # default model and flags
    python bench/server_path.py --quantization none --dtype float32 --repeats 5

Each measurement runs in a fresh process (the engine alone, or `python -m app` with a
client in this process), the three kinds alternate, and each reports the median over
--repeats runs of the decode rate seen by the consumer: (tokens - 1) / (last - first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from servers import start, stop  # noqa: E402

QUESTION = "Write a long story about a lighthouse keeper and a storm."


def engine_alone(args) -> float:
    """Run in a child process: one request through LLMEngine, decode tok/s."""
    from app.__main__ import build_parser, engine_config
    from app.chat.prompt import Message
    from app.engine.engine_request import EngineRequest
    from app.engine.request import SamplingParams
    from app.llm import LLM

    flags = build_parser().parse_args(args.model_flags)
    llm = LLM(config=engine_config(flags))
    prompt = llm.chat_prompt([Message("user", QUESTION)])
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))  # warm-up
    engine = llm.engine
    engine.add_request(EngineRequest(prompt, params, "r"))
    stamps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps += [time.perf_counter()] * len(out.new_token_ids)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


class Server:
    def __init__(self, model_flags: list[str]) -> None:
        self.proc, self.url = start(model_flags)

    def stop(self) -> None:
        stop(self.proc)


def over_v1(server: Server, tokens: int) -> float:
    import httpx

    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    stamps = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def over_ws(server: Server, tokens: int) -> float:
    import websockets

    async def main() -> float:
        stamps = []
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:
            params = {"temperature": 0, "max_tokens": tokens, "ignore_eos": True}
            messages = [{"role": "user", "content": QUESTION}]  # a new conversation's history
            await ws.send(json.dumps({"type": "chat", "id": "t", "messages": messages,
                                      "conversation_id": os.urandom(8).hex(), "cache": False,
                                      "params": params}))  # fmt: skip
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "token":
                    stamps.append(time.perf_counter())
                elif frame["type"] == "error":
                    raise RuntimeError(f"/ws refused the turn: {frame}")
                elif frame["type"] == "done":
                    break
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine-alone", action="store_true", help=argparse.SUPPRESS)
    args, args.model_flags = ap.parse_known_args()
    if args.engine_alone:
        print(json.dumps(engine_alone(args)))
        return
    rates: dict[str, list[float]] = {"engine": [], "v1": [], "ws": []}
    for _ in range(args.repeats):
        child = subprocess.run(
            [sys.executable, __file__, "--engine-alone", "--tokens", str(args.tokens),
             *args.model_flags],
            capture_output=True, text=True, check=True, cwd=ROOT,
        )  # fmt: skip
        rates["engine"].append(json.loads(child.stdout.strip().splitlines()[-1]))
        server = Server(args.model_flags)
        try:
            over_v1(server, 8)  # warm-up
            rates["v1"].append(over_v1(server, args.tokens))
            rates["ws"].append(over_ws(server, args.tokens))
        finally:
            server.stop()
        print({k: [round(x, 1) for x in v] for k, v in rates.items()}, file=sys.stderr)
    med = {k: statistics.median(v) for k, v in rates.items()}
    flags = " ".join(args.model_flags) or "(default flags)"
    print(f"one request, {args.tokens} tokens, {flags}: median decode tok/s of {args.repeats}")
    print(f"  engine alone {med['engine']:6.1f}")
    for kind in ("v1", "ws"):
        ratio = med[kind] / med["engine"]
        print(f"  over /{kind:<2}     {med[kind]:6.1f}   {ratio:.2f}x the engine (target >= 0.95x)")


if __name__ == "__main__":
    main()
