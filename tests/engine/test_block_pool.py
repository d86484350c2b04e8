from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from app.engine.block_pool import NULL_BLOCK, BlockPool


def test_allocate_takes_from_the_head_and_free_appends_to_the_tail():
    pool = BlockPool(5)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [1, 2]
    pool.free(reversed(a))  # tail first: block 2 becomes the older free block
    b = pool.allocate(4)
    assert [x.block_id for x in b] == [3, 4, 2, 1]
    pool.check_integrity(Counter(x.block_id for x in b))


def test_freed_block_keeps_its_hash_until_reallocated():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    assert pool.cache_block(block, b"h1")
    pool.free([block])
    assert pool.get_cached(b"h1") is block  # still reusable
    pool.touch([block])  # a cache hit revives it
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([block])
    pool.allocate(2)  # now its memory is needed: the hash goes
    assert pool.get_cached(b"h1") is None and block.block_hash is None
    pool.check_integrity()


def test_duplicate_content_keeps_the_first_cached_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"same")
    assert not pool.cache_block(b, b"same")
    assert pool.get_cached(b"same") is a and b.block_hash is None


def test_misuse_raises_instead_of_corrupting():
    pool = BlockPool(3)
    with pytest.raises(RuntimeError):
        pool.allocate(3)  # only 2 usable blocks
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError):
        pool.free([block])
    with pytest.raises(RuntimeError):
        pool.free([pool.blocks[NULL_BLOCK]])
    pool.check_integrity()


def test_check_integrity_catches_a_wrong_reference_count():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.check_integrity(Counter(b.block_id for b in blocks))
    with pytest.raises(AssertionError):
        pool.check_integrity(Counter([blocks[0].block_id]))  # one holder went missing


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / share / cache / free sequences against a model of the holders."""

    @initialize(num_blocks=st.integers(2, 24))
    def setup(self, num_blocks):
        self.pool = BlockPool(num_blocks)
        self.holders: list[list[int]] = []  # each holder: a block table
        self.next_hash = 0

    @rule(n=st.integers(1, 6))
    def allocate(self, n):
        if n > self.pool.num_free_blocks:
            with pytest.raises(RuntimeError):
                self.pool.allocate(n)
            return
        blocks = self.pool.allocate(n)
        assert all(b.ref_count == 1 and b.block_hash is None for b in blocks)
        self.holders.append([b.block_id for b in blocks])

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def share(self, data):
        src = data.draw(st.sampled_from(self.holders))
        prefix = src[: data.draw(st.integers(1, len(src)))]
        self.pool.touch(self.pool.blocks[i] for i in prefix)
        self.holders.append(list(prefix))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def cache(self, data):
        table = data.draw(st.sampled_from(self.holders))
        block = self.pool.blocks[data.draw(st.sampled_from(table))]
        self.next_hash += 1
        self.pool.cache_block(block, self.next_hash.to_bytes(8, "little"))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data):
        table = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        self.pool.free(self.pool.blocks[i] for i in reversed(table))

    @rule(data=st.data())
    def hit_a_cached_block(self, data):
        cached = [b for b in self.pool.blocks if b.block_hash is not None]
        if not cached:
            return
        block = data.draw(st.sampled_from(cached))
        assert self.pool.get_cached(block.block_hash) is block
        self.pool.touch([block])
        self.holders.append([block.block_id])

    @invariant()
    def consistent(self):
        if hasattr(self, "pool"):
            self.pool.check_integrity(Counter(i for t in self.holders for i in t))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_touched_blocks_count_each_block_once_in_id_order():
    pool = BlockPool(10)
    a = pool.allocate(3)
    assert pool.num_touched == 3
    pool.free(a)
    pool.allocate(2)  # fresh blocks first (4, 5), the freed ones wait at the tail
    assert pool.num_touched == 5
    pool.allocate(4)  # 6..9: every block written once
    assert pool.num_touched == 9 == pool.num_blocks
