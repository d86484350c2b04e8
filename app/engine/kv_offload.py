"""K/V between the paged cache and the tier below it (app.kvtier).

Stores. When a request ends, its full blocks that have a prefix hash and are not in the
tier yet are copied out of the cache on the engine's thread (one index_select: ~0.1 ms
per 720 KB block) and handed to the store worker, which encodes and writes them in the
background. Storing at the end of a request, not only when the pool reuses a block's
memory, is what lets another process sharing the tier (a replica behind a router) find a
conversation's K/V while this one still holds it; `store="evict"` stores only blocks about
to be overwritten instead.

Loads. At admission, after the pool's own prefix lookup, the continuation of the
request's hash chain is fetched from the tier on a loader thread, but only if the cost
model says loading beats recomputing. The request waits at the head of the queue while
the others run; when its blocks have arrived (checked: checksum, fingerprint, key),
admission copies them into fresh blocks, registers their hashes in the prefix cache and
counts them as cached tokens. A missing, short, corrupt or foreign entry ends the
continuation there: those tokens are recomputed.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.config import TierConfig
from app.engine.block_pool import Block
from app.engine.kv_cache import KVCache
from app.kvtier.backends import open_tier
from app.kvtier.cost import LoadCostModel
from app.kvtier.entry import BadEntry, EntryLayout, decode_into
from app.kvtier.fingerprint import ModelFingerprint, checkpoint_digest, weights_digest
from app.kvtier.stats import TierCounters, TierStats
from app.kvtier.store_worker import StoreWorker
from app.kvtier.tier import Tier, TierUnavailable
from app.model.build import WeightFormat
from app.model.loader import LoadedModel

MAX_FETCHES = 16  # lookups remembered (only the head of the queue asks, a few at most)


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierPrefix:
    """Blocks fetched from the tier: blocks `start` .. `start + num_blocks` of a
    request's hash chain, checked and unpacked."""

    start: int
    hashes: tuple[bytes, ...]
    payload: torch.Tensor  # (num_blocks, layers, 2, block_size, kv_heads, head_dim), CPU
    windowed: tuple[bool, ...]  # per block: its local layers' K/V was given back

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def after(self, start: int) -> TierPrefix | None:
        """The part from block `start` on (the pool may have gained blocks meanwhile)."""
        skip = start - self.start
        if skip == 0:
            return self
        if skip >= self.num_blocks:
            return None
        return TierPrefix(start, self.hashes[skip:], self.payload[skip:], self.windowed[skip:])

    def first(self, n: int) -> TierPrefix | None:
        """Its first `n` blocks (None for none)."""
        if n <= 0:
            return None
        return TierPrefix(self.start, self.hashes[:n], self.payload[:n], self.windowed[:n])


@dataclass(frozen=True)
class TierLookup:
    """What the tier offers a request now: blocks, nothing, or "still fetching"."""

    prefix: TierPrefix | None = None
    pending: bool = False


NOTHING = TierLookup()
PENDING = TierLookup(pending=True)


@dataclass
class _Fetch:
    start: int
    future: cf.Future[TierPrefix | None] | None  # None: decided not to fetch


class KVOffload:
    """Stores blocks' K/V into a tier and loads them back into the cache."""

    def __init__(
        self, kv_cache: KVCache, tier: Tier, fingerprint: ModelFingerprint, config: TierConfig
    ) -> None:
        self.tier = tier
        self.config = config
        self.store_on_evict = config.store == "evict"
        # (num_blocks, layers, 2, block_size, kv_heads, head_dim): a view, block first
        self._blocks = kv_cache.tensor.movedim(2, 0)
        self.layout = EntryLayout(
            fingerprint.digest, kv_cache.tensor.dtype, tuple(self._blocks.shape[1:])
        )
        self.counters = TierCounters()
        self.worker = StoreWorker(tier, self.layout, self.counters, known_ttl_s=config.ttl_s / 2)
        self.cost = LoadCostModel.for_backend(
            config.kind, self.layout.payload_bytes, kv_cache.block_size, config.min_load_speedup
        )
        self._loader = cf.ThreadPoolExecutor(1, thread_name_prefix="parley-kv-load")
        self._fetches: OrderedDict[str, _Fetch] = OrderedDict()

    # -- stores --------------------------------------------------------------------------

    def save(self, blocks: Sequence[Block]) -> None:
        """Hand the hashed blocks among `blocks` that the tier lacks to the store worker.
        Their K/V is copied now: after this call the blocks may be overwritten."""
        hashed = [b for b in blocks if b.block_hash is not None]
        if not hashed:
            return
        if not self.tier.available:
            self.counters.add(stores_dropped=len(hashed))
            return
        keys = [b.block_hash for b in hashed]
        chosen = [(b, k) for b, k, w in zip(hashed, keys, self.worker.wanted(keys)) if w]
        if not chosen:
            return
        t0 = time.perf_counter()
        ids = torch.tensor([b.block_id for b, _ in chosen], device=self._blocks.device)
        data = self._blocks.index_select(0, ids).cpu()
        self.counters.observe("copy", time.perf_counter() - t0)
        self.worker.submit([k for _, k in chosen], data, [b.windowed for b, _ in chosen])

    # -- loads ---------------------------------------------------------------------------

    def lookup(self, request_id: str, chain: Sequence[bytes], start: int) -> TierLookup:
        """The tier's continuation of `chain` (a request's block hashes, as many as it may
        reuse) after its first `start` blocks, which the pool holds. Starts a fetch when
        none is under way; PENDING until it has arrived."""
        wanted = len(chain) - start
        if wanted <= 0 or not self.tier.available:
            return NOTHING
        fetch = self._fetches.get(request_id)
        if fetch is None or fetch.start > start:  # none yet, or the pool lost blocks since
            fetch = self._start_fetch(chain, start)
            self._fetches[request_id] = fetch
            while len(self._fetches) > MAX_FETCHES:
                self._fetches.popitem(last=False)
        if fetch.future is None:
            return NOTHING
        if not fetch.future.done():
            return PENDING
        prefix = fetch.future.result()
        found = prefix.after(start) if prefix is not None else None
        return TierLookup(found) if found is not None else NOTHING

    def _start_fetch(self, chain: Sequence[bytes], start: int) -> _Fetch:
        wanted = len(chain) - start
        if not self.cost.worth_loading(wanted):
            self.counters.add(loads_skipped=1)
            return _Fetch(start, None)
        if not self.tier.remote and not self.tier.contains(chain[start]):
            self.counters.add(misses=wanted)  # a local tier answers this without a thread
            return _Fetch(start, None)
        keys = tuple(chain[start:])
        return _Fetch(start, self._loader.submit(self._fetch, keys, start))

    def _fetch(self, keys: tuple[bytes, ...], start: int) -> TierPrefix | None:
        """On the loader thread: get, check and unpack the longest run of good entries."""
        t0 = time.perf_counter()
        try:
            entries = self.tier.get_many(keys)
        except TierUnavailable:
            self.counters.error("unreachable", None)  # the backend logged it
            return None
        except Exception as exc:
            self.counters.error("load", f"loading {len(keys)} blocks failed: {exc!r}")
            return None
        n = next((i for i, e in enumerate(entries) if e is None), len(entries))
        payload = torch.empty((n, *self.layout.shape), dtype=self.layout.dtype)
        good = 0
        windowed: list[bool] = []
        for key, entry in zip(keys[:n], entries[:n]):
            assert entry is not None
            try:
                windowed.append(decode_into(self.layout, key, entry, payload[good]))
            except BadEntry as exc:
                self.counters.error(exc.reason, f"entry {key.hex()[:16]}: {exc}")
                with contextlib.suppress(Exception):
                    self.tier.discard(key)  # nobody should trip over it again
                break
            good += 1
        seconds = time.perf_counter() - t0
        self.counters.add(misses=len(keys) - good)
        self.counters.observe("load", seconds)
        self.cost.observe_load(good * self.layout.entry_bytes, seconds)
        if not good:
            return None
        return TierPrefix(start, keys[:good], payload[:good], tuple(windowed))

    def restore(self, prefix: TierPrefix, blocks: Sequence[Block]) -> None:
        """Copy fetched K/V into `blocks` (fresh ones, as many as the prefix has)."""
        assert len(blocks) == prefix.num_blocks
        t0 = time.perf_counter()
        device = self._blocks.device
        ids = torch.tensor([b.block_id for b in blocks], device=device)
        self._blocks.index_copy_(0, ids, prefix.payload.to(device))
        self.counters.observe("copy", time.perf_counter() - t0)
        self.counters.add(hits=len(blocks))

    def forget(self, request_id: str) -> None:
        """The request was admitted (or is gone): drop what was fetched for it."""
        self._fetches.pop(request_id, None)

    def wait(self, timeout: float) -> None:
        """Block until a fetch under way completes, at most `timeout` seconds (an engine
        with nothing else to do waits here instead of spinning)."""
        futures = [
            f.future for f in self._fetches.values() if f.future is not None and not f.future.done()
        ]
        if futures:
            cf.wait(futures, timeout, return_when=cf.FIRST_COMPLETED)

    # -- bookkeeping ---------------------------------------------------------------------

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe_compute(num_tokens, seconds)

    def stats(self) -> TierStats:
        usage = self.tier.usage()
        return self.counters.snapshot(self.tier.name, self.tier.available, usage.bytes,
                                      usage.blocks)  # fmt: skip

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued store is written (tests, benchmarks)."""
        return self.worker.flush(timeout)

    def close(self) -> None:
        self.worker.close()
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.tier.close()


def model_fingerprint(loaded: LoadedModel, fmt: WeightFormat, block_size: int) -> ModelFingerprint:
    """What K/V in the tier must have been computed with to be valid here (the format as
    resolved: "auto" means different things on different CPUs)."""
    source = loaded.source
    return ModelFingerprint(
        weights=weights_digest(loaded.weights) if source is None else checkpoint_digest(source),
        arch=repr(loaded.arch),
        dtype=fmt.dtype,
        quantization=fmt.quantization,
        block_size=block_size,
    )


def open_offload(
    config: TierConfig, kv_cache: KVCache, fingerprint: ModelFingerprint | None
) -> KVOffload | None:
    """The tier below this cache, or None (no tier, or no prefix caching to find it by)."""
    if fingerprint is None:
        return None
    tier = open_tier(config, fingerprint.hex)
    log.info("KV tier: %s (model fingerprint %s, stores on %s)", tier.name,
             fingerprint.hex[:12], config.store)  # fmt: skip
    return KVOffload(kv_cache, tier, fingerprint, config)
