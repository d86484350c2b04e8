"""The K/V pool's memory: zeros from the start, resident only as it is written."""

from __future__ import annotations

import mmap

import pytest
import torch

from app.config import CacheConfig
from app.engine.kv_cache import KVCache, available_memory
from tests.tiny import tiny_arch


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_the_pool_is_zeros_and_resident_only_where_written():
    arch = tiny_arch(64)
    before = resident_mib()
    cache = KVCache(arch, CacheConfig(kv_cache_bytes=512 << 20), dtype=torch.bfloat16)
    assert cache.nbytes > 500 << 20
    assert resident_mib() - before < 64  # not the 512 MiB that torch.zeros would touch
    k, v = cache.layers[0]
    assert not k[:8].any() and not v[-8:].any()  # zeros, first blocks and last
    k[:100] = 1.0  # written blocks become resident, and stay what was written
    assert k[:100].eq(1).all() and not k[100:108].any()
    assert resident_mib() - before < 64 + 100 * k[0].nbytes / 2**20


def test_copy_blocks_moves_every_layer():
    arch = tiny_arch(64)
    cache = KVCache(arch, CacheConfig(kv_cache_bytes=4 << 20))
    for i, (k, v) in enumerate(cache.layers):
        k[3], v[3] = i + 1.0, -(i + 1.0)
    cache.copy_blocks([(3, 5)])
    for i, (k, v) in enumerate(cache.layers):
        assert k[5].eq(i + 1.0).all() and v[5].eq(-(i + 1.0)).all()


def test_a_pool_larger_than_the_memory_is_refused_at_start():
    available = available_memory()
    assert available is not None and available > 0
    with pytest.raises(ValueError, match="does not fit"):
        KVCache(tiny_arch(64), CacheConfig(kv_cache_bytes=4 * available))


def test_local_layers_give_back_the_memory_of_released_blocks():
    """Gemma-like: 5 local layers of 6, K/V of 1 x 256 bf16 (8 KiB a block and layer)."""
    arch = tiny_arch(64, architecture="gemma3", num_layers=6, num_kv_heads=1, num_heads=4,
                     head_dim=256, local_window=512, global_every=6)  # fmt: skip
    cache = KVCache(arch, CacheConfig(kv_cache_bytes=96 << 20), dtype=torch.bfloat16)
    assert cache.can_release and cache.local_window == 512 and cache.local_layers == [0, 1, 2, 3, 4]
    before = resident_mib()
    n = cache.budget_blocks  # the blocks 96 MiB holds full (the map has room for more)
    cache.tensor[:, :, 1:n].fill_(1.0)  # every such block of every layer written
    written = resident_mib() - before
    assert written > 90
    cache.release_local(range(1, n - 10))  # all but the last 10 blocks (and the null block)
    freed = written - (resident_mib() - before)
    assert freed > 0.8 * written * 5 / 6, (freed, written)  # the local layers' part
    assert not cache.tensor[:5, :, 1 : n - 10].any()  # reads as zeros now
    assert cache.tensor[:5, :, n - 10 : n].eq(1).all() and cache.tensor[5].ne(0).any()
    cache.tensor[0, 0, 3] = 2.0  # a released block written again holds what it is given
    assert cache.tensor[0, 0, 3].eq(2).all()


def test_only_the_cpu_pool_of_a_model_with_local_layers_releases(monkeypatch):
    assert not KVCache(tiny_arch(64), CacheConfig(kv_cache_bytes=4 << 20)).can_release
    arch = tiny_arch(64, architecture="gemma3", local_window=8, global_every=2)
    meta = KVCache(arch, CacheConfig(kv_cache_bytes=4 << 20), device="meta")
    assert meta.local_layers == [0] and not meta.can_release
    cpu = KVCache(arch, CacheConfig(kv_cache_bytes=4 << 20))
    assert cpu.can_release
    monkeypatch.delattr(mmap, "MADV_REMOVE")  # macOS, Windows: nothing is given back
    assert not cpu.can_release
    cpu.release_local([1, 2])  # a no-op, not an error
    elsewhere = KVCache(arch, CacheConfig(kv_cache_bytes=4 << 20))
    assert elsewhere.windowed_bytes_per_block == elsewhere.bytes_per_block  # no room promised


def test_the_map_has_room_for_the_blocks_that_windowed_memory_holds():
    """A windowed block keeps 1 layer of 6: the map is made for 6 times the blocks the
    asked-for bytes hold full, resident only as written; release_blocks gives a whole
    block back (a free block the pool drops)."""
    arch = tiny_arch(64, architecture="gemma3", num_layers=6, num_kv_heads=1, num_heads=4,
                     head_dim=256, local_window=512, global_every=6)  # fmt: skip
    before = resident_mib()
    cache = KVCache(arch, CacheConfig(kv_cache_bytes=96 << 20), dtype=torch.bfloat16)
    assert cache.budget_blocks == (96 << 20) // cache.bytes_per_block
    assert cache.windowed_bytes_per_block == cache.bytes_per_block // 6
    assert cache.num_blocks == 6 * cache.budget_blocks and cache.nbytes <= 96 << 20
    assert resident_mib() - before < 16
    cache.tensor[:, :, 1:201].fill_(1.0)
    written = resident_mib() - before
    cache.release_blocks(range(1, 201))
    assert written - (resident_mib() - before) > 0.9 * 200 * cache.bytes_per_block / 2**20
    assert not cache.tensor[:, :, 1:201].any()
    # Kept as asked: without release, on another device, or where nothing is given back.
    kept = KVCache(arch, CacheConfig(96 << 20, release_out_of_window=False), torch.bfloat16)
    assert kept.num_blocks == kept.budget_blocks
    assert kept.windowed_bytes_per_block == kept.bytes_per_block


def test_no_address_space_for_the_larger_map_means_the_asked_for_one(monkeypatch):
    import app.engine.kv_cache as kv_cache

    made = []

    def zeros(shape, dtype, device):
        made.append(shape[2])
        if len(made) == 1:
            raise OSError(12, "Cannot allocate memory")
        return real(shape, dtype, device)

    real = kv_cache._zeros
    monkeypatch.setattr(kv_cache, "_zeros", zeros)
    arch = tiny_arch(64, architecture="gemma3", num_layers=6, num_kv_heads=1, num_heads=4,
                     head_dim=256, local_window=512, global_every=6)  # fmt: skip
    cache = KVCache(arch, CacheConfig(kv_cache_bytes=16 << 20), dtype=torch.bfloat16)
    assert made == [6 * cache.budget_blocks, cache.budget_blocks]
    assert cache.num_blocks == cache.budget_blocks
    assert cache.windowed_bytes_per_block == cache.bytes_per_block  # no capacity promised
