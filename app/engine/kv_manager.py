"""Block tables of requests, and the three ways a request finds its prefix already computed.

1. The prefix cache. A full block is named by a hash chained from its parent's hash and
   its own token ids, so equal hashes mean equal prefixes, not just equal blocks.
2. Session pins. A conversation keeps the blocks of its last turn (prompt and reply, the
   partial last block included) and the token ids they hold. Its next turn reuses the
   longest common token prefix with the pin, to the token, not to the block.
3. The KV tier (optional, app.engine.kv_offload): blocks that left the pool, found by the
   same hashes. It continues the prefix cache's run when no pin covers more; its blocks
   are loaded into fresh blocks at allocation.

A new request starts with whichever covers more.

Local layers (a sliding window, as in Gemma 3) read only the keys of the last `window`
positions. A block that fell out of its holder's window, and that nobody else holds, gives
its K/V in those layers back (`release`, KVCache.release_local) and is marked windowed;
it stays in the table and in the prefix cache for the global layers. A computed prefix is
then usable only up to a point whose last window of positions is whole
(`_whole_window`): a conversation's next turn, which goes on from its end, loses nothing;
a prompt that shares only the beginning of a long one computes it again.

Choices of one prompt (n > 1) share its blocks by reference count (fork). A block that is
shared and only partly filled is copied when a holder first writes into it (copy on
write): allocate_slots gives the writer a fresh block and records the copy, which the
model runner makes before the step's forward pass (SchedulerOutput.block_copies).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.engine.block_pool import Block, BlockPool
from app.engine.request import Request
from app.engine.session_pins import SessionPins

if TYPE_CHECKING:
    from app.engine.kv_offload import KVOffload, TierPrefix


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """A collision-resistant name for a block's content and everything before it."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def salt_root(salt: str | None) -> bytes | None:
    """The parent of a request's first block: a salt (vLLM's cache_salt) starts a chain
    of hashes that no request with another salt can produce."""
    if salt is None:
        return None
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"parley-salt").digest()


@dataclass
class ComputedPrefix:
    """What a new request can skip: `num_tokens` tokens whose K/V are in `blocks`, then
    (when `tier` is set) in the tier's blocks that follow them."""

    blocks: list[Block]
    num_tokens: int
    from_pin: bool = False
    tier: TierPrefix | None = None
    num_tier_tokens: int = 0  # of num_tokens, those loaded from the tier
    pending: bool = False  # the tier is still fetching this request's blocks: wait


class KVCacheManager:
    """Maps requests to blocks. Check, then commit: allocate_slots either gets every block
    a step needs or changes nothing."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        enable_prefix_caching: bool = True,
        offload: KVOffload | None = None,
        window: int | None = None,
        release: Callable[[list[int]], None] | None = None,
    ):
        self.pool = pool
        self.block_size = block_size
        # The local layers' window (None: the model has none), and how their K/V is given
        # back (None: it is not here; a block may still come windowed from the KV tier).
        self.window = window
        self._release = release
        self._unreleased: dict[str, int] = {}  # the first block of a table not yet released
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = offload if enable_prefix_caching else None  # the tier needs hashes
        self.pins = SessionPins(pool, block_size)
        self._tables: dict[str, list[Block]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a table already cached
        self._copies: list[tuple[int, int]] = []  # (source, destination) block ids to copy

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, request: Request) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else salt_root(request.cache_salt)
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def get_computed(self, request: Request) -> ComputedPrefix:
        """The longest already-computed prefix of the request's tokens. At least one token
        is always left to compute: its logits give the next token."""
        limit = request.num_tokens - 1
        best = ComputedPrefix([], 0)
        if not request.use_prefix_cache:
            return best
        chain: list[bytes] = []
        if self.enable_prefix_caching:
            self._update_hashes(request)
            chain = request.block_hashes[: limit // self.block_size]
            for h in chain:
                block = self.pool.get_cached(h)
                if block is None:
                    break
                best.blocks.append(block)
            best.num_tokens = self._whole_window(
                [b.windowed for b in best.blocks], len(best.blocks) * self.block_size
            )
            del best.blocks[best.num_tokens // self.block_size :]
        if request.session_id is not None:
            blocks, n = self.pins.lookup(request.session_id, request.all_token_ids, limit)
            n = self._whole_window([b.windowed for b in blocks], n)
            if n > best.num_tokens:
                return ComputedPrefix(blocks[: -(-n // self.block_size)], n, from_pin=True)
        if self.offload is not None:
            found = self.offload.lookup(request.request_id, chain, len(best.blocks))
            best.pending = found.pending
            if found.prefix is not None:
                self._take_tier(best, found.prefix)
        return best

    def _take_tier(self, best: ComputedPrefix, prefix: TierPrefix) -> None:
        """`best` goes on with the tier's blocks, as far as its last window is whole."""
        bs = self.block_size
        flags = [b.windowed for b in best.blocks] + list(prefix.windowed)
        n = self._whole_window(flags, len(flags) * bs)
        tier = prefix.first(n // bs - len(best.blocks))
        if tier is None:  # the pool's part alone (whole on its own)
            return
        best.tier = tier
        best.num_tier_tokens = tier.num_blocks * bs
        best.num_tokens += best.num_tier_tokens

    def _whole_window(self, windowed: list[bool], n: int) -> int:
        """The longest prefix of `n` tokens in blocks `windowed` says of (at most n, 0 at
        worst) after which the local layers still have what they attend to: no windowed
        block among those of its last `window` positions."""
        if self.window is None:
            return n
        bs = self.block_size
        while n > 0:
            first = max(0, n - self.window + 1) // bs  # the next query's first key's block
            gone = next((i for i in range(first, -(-n // bs)) if windowed[i]), None)
            if gone is None:
                return n
            # Every end after that block's start has it among its last window's: end
            # there, and look again.
            n = gone * bs
        return 0

    def release_behind_window(self, request: Request) -> None:
        """After a step: give back the local-layer K/V of the request's blocks that fell
        out of its window and that it alone holds (one another request shares may still
        be in that one's window)."""
        if self.window is None or self._release is None:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if not table:
            return
        start = self._unreleased.get(rid, 0)
        end = min(self._behind(request.num_computed_tokens), len(table))
        if end <= start:
            return
        self._unreleased[rid] = end
        self._release_blocks(table[start:end])

    def _behind(self, num_tokens: int) -> int:
        """How many leading blocks of `num_tokens` computed tokens may give their local K/V
        back. The next query, at position num_tokens, attends to the keys after
        num_tokens - window; block i's last is (i + 1) * bs - 1. One block more is kept:
        a prompt that goes on from these tokens finds them by whole blocks (the prefix
        cache), so its computed prefix may end up to a block earlier, and its window with
        it."""
        return max(0, (num_tokens - self.window + 1) // self.block_size - 1)

    def _release_blocks(self, blocks: list[Block]) -> None:
        mine = [b for b in blocks if b.ref_count == 1 and not b.windowed]
        if mine:
            assert self._release is not None
            self._release([b.block_id for b in mine])
            self.pool.mark_windowed(mine)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedPrefix | None = None
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after taking the
        computed prefix, which must start its table). False: not enough memory; nothing
        changed."""
        hits = computed.blocks if computed else []
        table = self._tables.get(request.request_id, [])
        done = computed.num_tokens if computed else request.num_computed_tokens
        needed = self.num_blocks_for(done + num_new_tokens) - len(table) - len(hits)
        # Hits sitting in the free queue leave it when touched: they are not spare memory.
        revived = sum(1 for b in hits if b.ref_count == 0)
        shared = self._shared_partial(table, done) if num_new_tokens > 0 else None
        if max(needed, 0) + (shared is not None) > self.pool.num_free_blocks - revived:
            return False
        self.pool.touch(hits)
        table = self._tables.setdefault(request.request_id, table)
        table.extend(hits)
        if computed is not None:
            self._num_hashed[request.request_id] = computed.num_tokens // self.block_size
        if shared is not None:
            self._save_before_reuse(1)
            (own,) = self.pool.allocate(1)
            self._copies.append((table[shared].block_id, own.block_id))
            self.pool.free([table[shared]])  # still held by the others: it stays in use
            table[shared] = own
        fresh = len(table)
        if needed > 0:
            self._save_before_reuse(needed)
            table.extend(self.pool.allocate(needed))
        if computed is not None and self.offload is not None:
            self.offload.forget(request.request_id)
            if computed.tier is not None:  # the first fresh blocks take the tier's K/V
                self._load(computed.tier, table[fresh : fresh + computed.tier.num_blocks])
        return True

    def _shared_partial(self, table: list[Block], num_tokens: int) -> int | None:
        """The index in `table` of the block that token `num_tokens` is written into, when
        that block is partly filled and someone else holds it too (copy it first)."""
        i = num_tokens // self.block_size
        if num_tokens % self.block_size and i < len(table) and table[i].ref_count > 1:
            return i
        return None

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` every block of `parent` by reference (another choice of the same
        computed prompt). Takes no free block: a shared block is copied only when a holder
        first writes into it (allocate_slots)."""
        table = self._tables[parent.request_id]
        if child.request_id in self._tables:
            raise RuntimeError(f"request {child.request_id} already has blocks")
        self.pool.touch(table)
        self._tables[child.request_id] = list(table)
        self._unreleased[child.request_id] = self._unreleased.get(parent.request_id, 0)
        self._num_hashed[child.request_id] = self._num_hashed.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies recorded since the last call: (source, destination) ids."""
        copies, self._copies = self._copies, []
        return copies

    def _save_before_reuse(self, n: int) -> None:
        """With the tier storing on eviction: save the cached blocks whose memory the next
        `n` allocations reuse."""
        if self.offload is not None and self.offload.store_on_evict:
            self.offload.save(self.pool.peek_free(n))

    def _load(self, prefix: TierPrefix, blocks: list[Block]) -> None:
        """Fill fresh blocks with K/V from the tier and make them findable by their
        hashes, as if computed here."""
        assert self.offload is not None
        self.offload.restore(prefix, blocks)
        windowed = [b for b, w in zip(blocks, prefix.windowed) if w]
        if windowed and self._release is not None:  # what the tier gave as zeros
            self._release([b.block_id for b in windowed])
        self.pool.mark_windowed(windowed)
        for block, block_hash in zip(blocks, prefix.hashes, strict=True):
            self.pool.cache_block(block, block_hash)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full and computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables[rid]
        full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_hashed.get(rid, 0)
        if full <= start:
            return
        self._update_hashes(request)
        for i in range(start, full):
            self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_hashed[rid] = full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (see BlockPool.free)."""
        table = self._tables.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        self._unreleased.pop(request.request_id, None)
        self.pool.free(reversed(table))

    def free_or_pin(self, request: Request) -> None:
        """At the end of a request: a session's request hands its computed blocks to the
        session's pin (replacing the old pin); any other request frees them."""
        if request.session_id is None:
            self._store(request, self._tables.get(request.request_id, []))
            self.free(request)
            return
        table = self._tables.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        self._unreleased.pop(request.request_id, None)
        self._store(request, table)
        tokens = request.all_token_ids[: request.num_computed_tokens]
        keep = self.num_blocks_for(len(tokens))
        self.pool.free(reversed(table[keep:]))  # a block allocated for the next token
        self.pins.pin(request.session_id, table[:keep], tokens)
        if self._release is not None:  # what it shared while it ran may be the pin's alone now
            self._release_blocks(table[: self._behind(len(tokens))])

    def forget_lookup(self, request: Request) -> None:
        """A waiting request is gone: drop what the tier fetched for it."""
        if self.offload is not None:
            self.offload.forget(request.request_id)

    def _store(self, request: Request, table: list[Block]) -> None:
        """A request ended well: its full blocks go to the tier (unless it asked for no
        reuse, `cache: false`, which also means its K/V is kept nowhere)."""
        offload = self.offload
        if offload is not None and not offload.store_on_evict and request.use_prefix_cache:
            offload.save(table)

    def holders(self) -> Counter[int]:
        held = Counter(b.block_id for table in self._tables.values() for b in table)
        held.update(self.pins.holders())
        return held

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.holders())
