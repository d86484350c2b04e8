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

    @initialize(num_blocks=st.integers(2, 24), windowed=st.booleans(), data=st.data())
    def setup(self, num_blocks, windowed, data):
        """A plain pool, or one whose windowed blocks keep 1 of 6 bytes, with ids for up
        to 6 times the full blocks its memory holds."""
        self.dropped: list[int] = []
        if windowed:
            limit = data.draw(st.integers(max(2, num_blocks // 6), num_blocks))
            self.pool = BlockPool(num_blocks, 6, 1, limit, drop=self.dropped.extend)
        else:
            self.pool = BlockPool(num_blocks)
        self.holders: list[list[int]] = []  # each holder: a block table
        self.next_hash = 0

    @rule(n=st.integers(1, 6))
    def allocate(self, n):
        if n > self.pool.num_free_blocks:
            with pytest.raises(RuntimeError):
                self.pool.allocate(n)
            return
        will_go = self.pool.peek_free(n)
        self.dropped.clear()
        blocks = self.pool.allocate(n)
        assert all(b.ref_count == 1 and b.block_hash is None for b in blocks)
        assert all(not b.windowed for b in blocks)
        # Whatever lost its K/V was announced, and only dropped blocks lost it all.
        assert set(self.dropped) <= {b.block_id for b in will_go} - {b.block_id for b in blocks}
        assert not any(self.pool.blocks[i].resident for i in self.dropped)
        self.holders.append([b.block_id for b in blocks])

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def window(self, data):
        table = data.draw(st.sampled_from(self.holders))
        self.pool.mark_windowed([self.pool.blocks[data.draw(st.sampled_from(table))]])

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


def test_written_blocks_are_counted_once_each_in_id_order():
    pool = BlockPool(10, block_bytes=100)
    a = pool.allocate(3)
    assert pool.resident == 4 * 100  # the null block and blocks 1-3
    pool.free(a)
    assert [b.block_id for b in pool.allocate(2)] == [4, 5]  # unwritten first
    assert pool.resident == 6 * 100
    pool.allocate(4)  # 6..9: every block written once
    assert pool.resident == 10 * 100 and pool.num_free_blocks == 3  # 1-3, reused in place


def windowed_pool(num_blocks=13, limit_blocks=5, dropped=None):
    """Blocks of 6 bytes that keep 1 once windowed: memory for 5 full blocks, ids for 13."""
    drop = dropped.extend if dropped is not None else None
    return BlockPool(num_blocks, 6, 1, limit_blocks, drop=drop)


def test_memory_given_back_by_windowed_blocks_holds_more_blocks():
    pool = windowed_pool()
    assert pool.num_blocks == 4 and pool.num_free_blocks == 4
    a = pool.allocate(4)
    assert pool.num_free_blocks == 0
    pool.mark_windowed(a[:3])  # 3 x 5 bytes given back: room for 2 more full blocks
    assert pool.num_free_blocks == 2 and pool.usage == 0.5
    b = pool.allocate(2)
    assert [x.block_id for x in b] == [5, 6] and pool.resident == 6 + 3 * 1 + 3 * 6
    pool.check_integrity(Counter(x.block_id for x in a + b))


def test_cached_free_blocks_are_dropped_for_memory_least_recently_freed_first():
    dropped = []
    pool = windowed_pool(dropped=dropped)
    a = pool.allocate(4)
    pool.mark_windowed(a[:2])  # blocks 1 and 2 keep 1 byte each: 20 bytes written
    for i, block in enumerate(a):
        pool.cache_block(block, bytes([i]))
    pool.free(a)  # in this order: block 1 freed first
    (b,) = pool.allocate(1)  # room for an unwritten block: the cached ones stay
    assert b.block_id == 5 and not dropped and pool.num_cached_blocks == 4
    # No room: the free queue's head is reused. It was windowed: its 5 bytes come back,
    # and the next cached block's memory makes room for them.
    assert pool.peek_free(1) == [pool.blocks[1], pool.blocks[2]]
    (c,) = pool.allocate(1)
    assert c.block_id == 1 and dropped == [2] and pool.resident == pool.limit == 30
    assert not pool.blocks[2].resident and pool.get_cached(bytes([1])) is None
    assert pool.get_cached(bytes([2])) is pool.blocks[3]  # a full one is kept
    pool.check_integrity(Counter([1, 5]))
    # A dropped block is unwritten again: the lowest such id comes first.
    pool.mark_windowed([b, c])
    assert [x.block_id for x in pool.allocate(1)] == [2]
    pool.check_integrity(Counter([1, 2, 5]))


def test_reusing_a_windowed_free_block_costs_its_local_layers_again():
    pool = windowed_pool(num_blocks=7, limit_blocks=3)
    (a,) = pool.allocate(1)
    pool.mark_windowed([a])
    pool.cache_block(a, b"a")
    pool.free([a])
    assert pool.resident == 6 + 1 and pool.num_free_blocks == 2
    pool.touch([a])  # a hit revives it as it is: 1 byte held
    assert pool.held == 7 and a.windowed
    pool.free([a])
    # Block 2 fits (13 bytes), a second unwritten one would not (19): block 1 is reused,
    # its local layers written again.
    assert [x.block_id for x in pool.allocate(2)] == [2, 1]
    assert pool.resident == pool.limit == 18 and not a.windowed and a.block_hash is None
    pool.check_integrity(Counter([1, 2]))
