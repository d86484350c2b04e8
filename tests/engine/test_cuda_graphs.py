"""The CPU-testable parts of the CUDA graph runner: which bucket a batch gets and how it
is padded. (Capture and replay run only on a GPU: tests/gpu.)"""

import pytest

from app.engine.cuda_graphs import DecodeBatch, bucket_for, decode_buckets, pad_decode_batch


def test_buckets_cover_every_batch_size_with_little_padding():
    assert decode_buckets(1) == [1]
    assert decode_buckets(16) == [1, 2, 4, 8, 16]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    for top in (1, 5, 16, 40, 64, 256):
        buckets = decode_buckets(top)
        assert buckets[-1] == top
        for n in range(1, top + 1):
            b = bucket_for(n, buckets)
            assert b is not None and n <= b
            assert b - n < 16  # never a whole bucket's step of padding
    assert bucket_for(65, decode_buckets(64)) is None


def test_padding_rows_write_and_read_only_the_null_block():
    batch = DecodeBatch([5, 6], [9, 3], [41, 14], [[10, 11, 12], [3, 0, 0]], [10, 4])
    padded = pad_decode_batch(batch, 4)
    assert padded.input_ids == [5, 6, 0, 0]
    assert padded.positions == [9, 3, 0, 0]
    assert padded.slots == [41, 14, 0, 0]  # slot 0: the null block
    assert padded.tables == [[10, 11, 12], [3, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert padded.context_lens == [10, 4, 1, 1]
    assert pad_decode_batch(batch, 2) == batch
    with pytest.raises(ValueError):
        pad_decode_batch(batch, 1)
