"""KV blocks: reference counts, an LRU free queue, and the prefix-hash map.

A block whose reference count drops to zero keeps its hash and joins the tail of the free
queue; allocation takes from the head and only then forgets the hash. So a freed prefix
stays reusable (a cache hit revives it) until its memory is actually needed, and the
blocks freed longest ago are overwritten first.

Block 0 is the null block: block tables are padded with it, it is never handed out.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from itertools import islice

NULL_BLOCK = 0


class Block:
    """One block of `block_size` token slots in every layer's K and V."""

    __slots__ = ("block_hash", "block_id", "ref_count", "windowed")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None  # set once the block is full and computed
        # Its K/V in the local (sliding-window) layers was given back: only a query more
        # than a window after it may use it (KVCacheManager.release_behind_window).
        self.windowed = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_count}, hash={h})"


class BlockPool:
    """Owns every block. Callers check `num_free_blocks` before `allocate` (check, then
    commit); the pool raises on misuse instead of corrupting its state."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK].ref_count = 1  # held forever: never free, never allocated
        # Insertion order is the LRU order: head = freed longest ago = next to reuse.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[bytes, Block] = {}
        # Blocks handed out at least once. Fresh blocks leave the queue in id order, so
        # these are blocks 1..num_touched: the part of the K/V memory ever written (the
        # pool's pages become resident on first write; see kv_cache).
        self.num_touched = 0
        self.num_windowed = 0  # blocks whose local layers' K/V was given back

    @property
    def num_blocks(self) -> int:
        """Blocks that can hold tokens (the null block excluded)."""
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by someone (0.0 - 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks from the head of the free queue, forgetting their old hashes."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            if block.windowed:  # its new holder writes every layer afresh
                block.windowed = False
                self.num_windowed -= 1
            block.ref_count = 1
            self.num_touched = max(self.num_touched, block.block_id)
            out.append(block)
        return out

    def peek_free(self, n: int) -> list[Block]:
        """The blocks the next allocate(n) would take (their hashes are about to go)."""
        return list(islice(self._free.values(), n))

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block (a prefix-cache hit); revives free ones."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in the given order. Blocks that reach zero
        join the tail of the free queue, so pass a request's blocks last-first: its tail
        (least shared) is then reused before its prefix."""
        for block in blocks:
            if block.ref_count <= 0 or block.block_id == NULL_BLOCK:
                raise RuntimeError(f"freeing {block}, which nobody holds")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: Block, block_hash: bytes) -> bool:
        """Register a full, computed block under its hash. Returns False when another
        block already holds the same content (two requests computed it at once): the
        first stays the cached one, unless it is windowed, when the whole copy takes
        its name (a later prompt that ends there can use it)."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        known = self._cached.get(block_hash)
        if known is not None:
            if not known.windowed or block.windowed:
                return False
            known.block_hash = None
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def mark_windowed(self, blocks: Iterable[Block]) -> None:
        """These blocks' local-layer K/V was given back."""
        for block in blocks:
            if not block.windowed:
                block.windowed = True
                self.num_windowed += 1

    def cached_hashes(self, limit: int) -> list[bytes]:
        """The hashes of at most `limit` findable blocks, the most recently cached last
        (what a replica publishes to a prefix-aware router). Safe to call from another
        thread: the list is taken in one step under the GIL (bytes keys run no Python
        code while hashing)."""
        hashes = list(self._cached)
        return hashes[-limit:] if limit < len(hashes) else hashes

    def reset_prefix_cache(self) -> None:
        """Forget every hash (new weights, or a benchmark that must compute every
        prompt): cached content is no longer findable."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()

    def check_integrity(self, holders: Counter[int] | None = None) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent.

        `holders` counts, per block id, how many block tables hold it; when given, each
        block's reference count must equal it exactly.
        """
        assert self.blocks[NULL_BLOCK].ref_count == 1, "null block reference changed"
        assert NULL_BLOCK not in self._free, "null block in the free queue"
        used = 0
        for block in self.blocks[1:]:
            assert block.ref_count >= 0, f"{block} has a negative reference count"
            in_free = block.block_id in self._free
            assert in_free == (block.ref_count == 0), f"{block}: free queue disagrees"
            used += block.ref_count > 0
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"{block}: hash not mapped"
            if holders is not None:
                assert block.ref_count == holders.get(block.block_id, 0), (
                    f"{block}: ref count {block.ref_count} but "
                    f"{holders.get(block.block_id, 0)} holders"
                )
        assert used + len(self._free) == self.num_blocks, "free + used != total"
        windowed = sum(b.windowed for b in self.blocks)
        assert windowed == self.num_windowed, f"{windowed} windowed, {self.num_windowed} counted"
        for h, block in self._cached.items():
            assert block.block_hash == h, f"hash map entry points to {block}"
