"""Block tables of requests, and the prefix cache that lets them share blocks.

A full block is named by a hash chained from its parent's hash and its own token ids, so
equal hashes mean equal prefixes, not just equal blocks. A new request looks its blocks up
by hash and starts with as many computed tokens as the longest run of hits covers.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter

from app.engine.block_pool import Block, BlockPool
from app.engine.request import Request


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """A collision-resistant name for a block's content and everything before it."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheManager:
    """Maps requests to blocks. Check, then commit: allocate_slots either gets every block
    a step needs or changes nothing."""

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[Block]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a table already cached

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, request: Request) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """The longest run of cached blocks that prefixes the request's tokens. At least
        one token is always left to compute: its logits give the next token."""
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for h in request.block_hashes[:limit]:
            block = self.pool.get_cached(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[Block] | None = None
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after taking the
        cache hits `computed`, which must extend its table). False: not enough memory;
        nothing changed."""
        computed = computed or []
        table = self._tables.get(request.request_id, [])
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        needed = self.num_blocks_for(total) - len(table) - len(computed)
        # Hits sitting in the free queue leave it when touched: they are not spare memory.
        revived = sum(1 for b in computed if b.ref_count == 0)
        if needed > self.pool.num_free_blocks - revived:
            return False
        self.pool.touch(computed)
        table = self._tables.setdefault(request.request_id, table)
        table.extend(computed)
        self._num_hashed.setdefault(request.request_id, 0)
        self._num_hashed[request.request_id] += len(computed)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

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
        self.pool.free(reversed(table))

    def holders(self) -> Counter[int]:
        return Counter(b.block_id for table in self._tables.values() for b in table)

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.holders())
