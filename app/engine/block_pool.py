"""KV blocks: reference counts, an LRU free queue, the prefix-hash map, and the memory
they hold.

A block whose reference count drops to zero keeps its hash and joins the tail of the free
queue; allocation takes from the head and only then forgets the hash. So a freed prefix
stays reusable (a cache hit revives it) until its memory is actually needed, and the
blocks freed longest ago are overwritten first.

Memory, not block count, is what the pool is limited by. A block holds a full block's bytes
once written, and fewer once `windowed` (its local layers' K/V given back: Gemma 3's
sliding window, KVCacheManager.release_behind_window). With such a model the pool may have
more block ids than its memory holds full blocks (KVCache sizes its memory map for them,
pages given out only as written), so the memory a long conversation gave back holds other
conversations' tokens, as vLLM's hybrid allocator's separate pools do. When a new block
needs memory that cached free blocks hold, the least recently freed of them are dropped
(hash forgotten, memory given back whole: `drop`). Without windowed blocks, or when their
memory is not given back, every block costs the same and this is a plain block pool.

Block 0 is the null block: block tables are padded with it, it is never handed out.
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

NULL_BLOCK = 0


class Block:
    """One block of `block_size` token slots in every layer's K and V."""

    __slots__ = ("block_hash", "block_id", "ref_count", "resident", "windowed")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None  # set once the block is full and computed
        # Its K/V in the local (sliding-window) layers was given back: only a query more
        # than a window after it may use it (KVCacheManager.release_behind_window).
        self.windowed = False
        self.resident = False  # written since its memory was last given back (or ever)

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_count}, hash={h})"


class BlockPool:
    """Owns every block. Callers check `num_free_blocks` before `allocate` (check, then
    commit); the pool raises on misuse instead of corrupting its state.

    `block_bytes` is a written block's memory and `windowed_bytes` a windowed one's
    (default: the same); `limit_blocks` full blocks' worth is all the memory there is
    (default: every block; the null block counts). `drop` gives whole blocks' memory back.
    """

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int = 1,
        windowed_bytes: int | None = None,
        limit_blocks: int | None = None,
        drop: Callable[[list[int]], None] | None = None,
    ) -> None:
        limit_blocks = num_blocks if limit_blocks is None else limit_blocks
        if min(num_blocks, limit_blocks) < 2 or limit_blocks > num_blocks:
            raise ValueError(
                f"a block pool needs at least 2 blocks and memory for at least 2 "
                f"(and for no more than it has), got {num_blocks} and {limit_blocks}"
            )
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.block_bytes = block_bytes
        self.windowed_bytes = block_bytes if windowed_bytes is None else windowed_bytes
        self.limit = limit_blocks * block_bytes
        self._drop = drop
        null = self.blocks[NULL_BLOCK]
        null.ref_count, null.resident = 1, True  # held forever: never free, never allocated
        self.held = self.resident = block_bytes  # bytes of held blocks / of all written ones
        # Free blocks that hold K/V, in LRU order: head = freed longest ago = next to reuse.
        self._free: OrderedDict[int, Block] = OrderedDict()
        # Free blocks that hold no memory (never written, or dropped), highest id first:
        # taken from the end, lowest first, so that the written part stays at the start.
        self._empty = list(range(num_blocks - 1, 0, -1))
        self._cached: dict[bytes, Block] = {}
        self.num_windowed = 0  # blocks whose local layers' K/V was given back

    @property
    def num_blocks(self) -> int:
        """Full blocks the pool's memory holds (the null block excluded): the most tokens
        one request can ever have is this many blocks' worth."""
        return self.limit // self.block_bytes - 1

    @property
    def num_free_blocks(self) -> int:
        """How many blocks `allocate` can give now: as many as there are free ids and
        memory for at full size, counting what cached free blocks hold as memory (they
        are dropped for it)."""
        return min(len(self._free) + len(self._empty), (self.limit - self.held) // self.block_bytes)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the pool's memory held by someone (0.0 - 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def cost(self, block: Block) -> int:
        """The memory `block` holds now."""
        if not block.resident:
            return 0
        return self.windowed_bytes if block.windowed else self.block_bytes

    def get_cached(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks, forgetting their old hashes: unwritten ones while there is memory
        for them, then from the head of the free queue; then drop the least recently freed
        cached blocks until what is written fits the memory again."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        take, drop = self._plan(n)
        for block in take:
            if block.resident:
                del self._free[block.block_id]
            else:
                self._empty.pop()  # _plan took them from the end, in order
            self.resident += self.block_bytes - self.cost(block)
            self._forget(block)
            block.resident = True  # its new holder writes every layer
            block.ref_count = 1
            self.held += self.block_bytes
        for block in drop:
            del self._free[block.block_id]
            self.resident -= self.cost(block)
            self._forget(block)
            block.resident = False
            bisect.insort(self._empty, block.block_id, key=lambda i: -i)  # descending
        if drop and self._drop is not None:
            self._drop([b.block_id for b in drop])
        return take

    def _plan(self, n: int) -> tuple[list[Block], list[Block]]:
        """The blocks allocate(n) takes, and those it drops to make room."""
        empty = self._empty[: -n - 1 : -1]  # its last n, last first
        lru = iter(self._free.values())
        resident, take = self.resident, []
        for _ in range(n):
            if empty and resident + self.block_bytes <= self.limit:
                block = self.blocks[empty.pop(0)]
            else:
                block = next(lru)
            resident += self.block_bytes - self.cost(block)
            take.append(block)
        drop = []
        while resident > self.limit:
            block = next(lru)
            resident -= self.cost(block)
            drop.append(block)
        return take, drop

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
        if block.windowed:
            block.windowed = False
            self.num_windowed -= 1

    def peek_free(self, n: int) -> list[Block]:
        """The written blocks the next allocate(n) would take or drop (their hashes and
        K/V are about to go)."""
        take, drop = self._plan(n)
        return [b for b in take if b.resident] + drop

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block (a prefix-cache hit); revives free ones."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
                self.held += self.cost(block)
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
                self.held -= self.cost(block)

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
        """These held blocks' local-layer K/V was given back."""
        for block in blocks:
            if not block.windowed:
                less = self.cost(block)
                block.windowed = True
                self.num_windowed += 1
                less -= self.cost(block)
                self.resident -= less
                self.held -= less if block.ref_count else 0

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
        used, held, resident = 0, self.block_bytes, self.block_bytes
        empty = set(self._empty)
        assert self._empty == sorted(empty, reverse=True), "empty blocks out of order"
        for block in self.blocks[1:]:
            assert block.ref_count >= 0, f"{block} has a negative reference count"
            in_free = block.block_id in self._free or block.block_id in empty
            assert in_free == (block.ref_count == 0), f"{block}: free queue disagrees"
            assert (block.block_id in empty) == (not block.resident), f"{block}: memory"
            assert block.resident or not (block.windowed or block.block_hash), f"{block}"
            used += block.ref_count > 0
            held += self.cost(block) if block.ref_count else 0
            resident += self.cost(block)
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"{block}: hash not mapped"
            if holders is not None:
                assert block.ref_count == holders.get(block.block_id, 0), (
                    f"{block}: ref count {block.ref_count} but "
                    f"{holders.get(block.block_id, 0)} holders"
                )
        assert used + len(self._free) + len(empty) == len(self.blocks) - 1, "free + used != all"
        assert (held, resident) == (self.held, self.resident), "memory miscounted"
        assert held <= resident <= self.limit, f"{resident} bytes written, {self.limit} there"
        windowed = sum(b.windowed for b in self.blocks)
        assert windowed == self.num_windowed, f"{windowed} windowed, {self.num_windowed} counted"
        for h, block in self._cached.items():
            assert block.block_hash == h, f"hash map entry points to {block}"
