"""python -m app: Parley from the command line.

    python -m app --prompt "What is the capital of France?"

generates one chat reply offline, streaming it to the terminal. (The chat server comes
with the server package.)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from app.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parley", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", help="a user message: print the model's reply and exit")
    p.add_argument("--system", help="a system prompt for --prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--kv-cache-size", type=parse_size, default="1GiB", help="e.g. 512MiB, 2GiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--log-level", default="warning")
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=args.model),
        cache=CacheConfig(kv_cache_bytes=args.kv_cache_size, block_size=args.block_size),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
        num_threads=args.threads,
    )


def generate_once(args: argparse.Namespace) -> None:
    from app.engine.engine import LLMEngine
    from app.engine.request import SamplingParams

    engine = LLMEngine(engine_config(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    ids = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    engine.add_request("cli", list(ids), params)
    out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
    print(flush=True)
    if out is not None and out.timings.first_token is not None:
        t = out.timings
        decode_s = (t.finished or time.monotonic()) - t.first_token
        rate = (out.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0
        print(
            f"[{out.prompt_tokens} prompt tokens, {out.completion_tokens} generated, "
            f"TTFT {t.ttft_s * 1000:.0f} ms, {rate:.1f} tok/s, finish: {out.finish_reason}]",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.prompt is None:
        build_parser().error("give --prompt (the chat server is not part of this build yet)")
    generate_once(args)


if __name__ == "__main__":
    main()
