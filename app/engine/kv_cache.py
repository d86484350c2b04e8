"""The paged K/V tensors: one allocation, sized in bytes, split into blocks.

Layout per layer: K and V each [num_blocks, block_size, num_kv_heads, head_dim]; token
slot = block_id * block_size + offset. All layers live in one tensor
[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] so the memory is taken
once and its size is exactly what was asked for (rounded down to whole blocks).

Measured and rejected: K and V of a token side by side in one tensor (one gather instead
of two) made a 32-sequence decode step ~15% slower end to end on 2 CPU cores.

Local layers (Gemma 3's sliding window) never read a key that fell out of their window.
On the CPU, `release_local` gives those blocks' memory in the local layers back to the
operating system (the pages of a shared anonymous map, punched out with MADV_REMOVE): a
long conversation then keeps resident the K/V its global layers need and one window's
worth in the others, as vLLM's hybrid allocator keeps. The memory given back holds more
blocks: the map is made for as many blocks as the asked-for bytes hold when every block
is windowed (its pages are given out only as written), and the block pool keeps what is
written within the asked-for bytes (BlockPool: `budget_blocks` full blocks' worth).
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterable

import torch

from app.config import CacheConfig
from app.model.arch import ArchConfig


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.kv_size * elem


class KVCache:
    """K/V memory for every layer."""

    def __init__(
        self,
        arch: ArchConfig,
        cfg: CacheConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        per_block = bytes_per_block(arch, cfg.block_size, dtype)
        self.budget_blocks = cfg.kv_cache_bytes // per_block  # what the asked-for bytes hold
        if self.budget_blocks < 2:
            raise ValueError(
                f"a KV cache of {cfg.kv_cache_bytes} bytes holds {self.budget_blocks} blocks; "
                f"one block of {cfg.block_size} tokens takes {per_block} bytes for this model"
            )
        self.block_size = cfg.block_size
        self.arch = arch  # the layout's heads: attention folds query heads by it
        self.bytes_per_block = per_block
        device = torch.device(device)
        # The local layers and their window (one size for all of them, as in Gemma 3).
        self.local_layers = [i for i in range(arch.num_layers) if arch.layer_window(i)]
        windows = [arch.layer_window(i) or 0 for i in self.local_layers]
        self.local_window: int | None = min(windows) if windows else None
        self.poison_released = False  # debug checks: released K/V reads as garbage, not 0
        # What a windowed block still holds, when release_local gives the rest back whole
        # pages at a time (each layer's slice of a block a whole number of pages).
        slice_bytes = self._slice_bytes
        self.windowed_bytes_per_block = per_block
        if (cfg.release_out_of_window and self.local_layers and device.type == "cpu"
                and hasattr(mmap, "MADV_REMOVE") and slice_bytes % mmap.PAGESIZE == 0):  # fmt: skip
            self.windowed_bytes_per_block -= 2 * len(self.local_layers) * slice_bytes
        # Checked now: a pool that cannot fit would otherwise fail only once it fills, in
        # the middle of serving, at the hands of the OOM killer.
        check_fits(self.budget_blocks * per_block)
        self.num_blocks = self.budget_blocks * per_block // self.windowed_bytes_per_block
        try:
            self.tensor, self._memory = self._zeros(dtype, device)
        except OSError:  # no address space for the larger map: the asked-for bytes only
            self.num_blocks, self.windowed_bytes_per_block = self.budget_blocks, per_block
            self.tensor, self._memory = self._zeros(dtype, device)
        self.layers = [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(arch.num_layers)]

    def _zeros(self, dtype: torch.dtype, device: torch.device):
        # Zeros, not empty: padded block tables read the null block, and masked garbage
        # could be NaN, which survives a zero attention weight (0 * NaN = NaN).
        arch = self.arch
        shape = (arch.num_layers, 2, self.num_blocks, self.block_size, arch.num_kv_heads)
        return _zeros((*shape, arch.head_dim), dtype, device)

    @property
    def can_release(self) -> bool:
        """Whether release_local gives memory back (local layers, on the CPU, where the
        operating system punches holes in shared memory: Linux's MADV_REMOVE)."""
        return self._memory is not None and bool(self.local_layers) and hasattr(mmap, "MADV_REMOVE")

    def release_local(self, block_ids: Iterable[int]) -> None:
        """Give back the memory these blocks hold in the local layers: none of those layers
        will read it again (its keys fell out of their window). It reads as zeros after,
        or, under `poison_released`, as a value far from any K/V, so that a kernel that
        read it anyway would change its output."""
        if self.can_release:
            self._give_back(block_ids, self.local_layers)

    def release_blocks(self, block_ids: Iterable[int]) -> None:
        """Give back the memory these blocks hold in every layer (free blocks the pool
        drops: nobody reads them before writing them again); as release_local."""
        if self._memory is not None:
            self._give_back(block_ids, range(self.arch.num_layers))

    def _give_back(self, block_ids: Iterable[int], layers: Iterable[int]) -> None:
        ids = sorted(set(block_ids))
        if not ids:
            return
        assert self._memory is not None
        per, page = self._slice_bytes, mmap.PAGESIZE
        for first, last in _runs(ids):
            for layer in layers:
                for kv in (0, 1):
                    if self.poison_released:
                        self.tensor[layer, kv, first : last + 1].fill_(1e4)
                        continue
                    base = (layer * 2 + kv) * self.num_blocks * per
                    start = -(-(base + first * per) // page) * page  # whole pages inside
                    end = (base + (last + 1) * per) // page * page
                    if end > start:
                        self._memory.madvise(mmap.MADV_REMOVE, start, end - start)

    @property
    def _slice_bytes(self) -> int:
        """One block's bytes in one layer's K (or V)."""
        return self.bytes_per_block // (2 * self.arch.num_layers)

    @property
    def nbytes(self) -> int:
        """The memory the K/V may hold (the map itself may be larger)."""
        return self.budget_blocks * self.bytes_per_block

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks, every layer's K and V: (source, destination) block ids
        (copy on write of a block that choices of one prompt shared)."""
        src = torch.tensor([s for s, _ in copies], device=self.tensor.device)
        dst = torch.tensor([d for _, d in copies], device=self.tensor.device)
        # [layers, 2, num_blocks, ...]: one gather and one scatter along the block axis
        self.tensor.index_copy_(2, dst, self.tensor.index_select(2, src))


def _runs(ids: list[int]) -> Iterable[tuple[int, int]]:
    """(first, last) of each run of consecutive ids in sorted `ids`."""
    first = prev = ids[0]
    for i in ids[1:]:
        if i != prev + 1:
            yield first, prev
            first = i
        prev = i
    yield first, prev


def _zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zeroed tensor, and on the CPU the memory map it lies in: an anonymous one, whose
    pages the kernel gives out (as zeros) only when first written, so that the pool becomes
    resident as it fills, not at start. (`torch.zeros` writes every page at once: a laptop
    chatting in one tab held the whole default 1 GiB.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    # Anonymous, and shared (mmap's default; shmem to the kernel): zero-filled. (Measured
    # and not kept: a private mapping on 2 MiB pages, as the weights' arena, took the
    # attention over 6,000 keys 0.85-0.88x in a kernel bench, but the decode step deep in a
    # chat not measurably (bench/README.md), and the pool would become resident 2 MiB a
    # layer's K or V at a time.)
    memory = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape), memory


def check_fits(nbytes: int, what: str | None = None) -> None:
    """Raise ValueError if `nbytes` of K/V (`what`, for the message) cannot fit in the
    memory available now."""
    available = available_memory()
    if available is not None and nbytes > available:
        what = what or f"a KV cache of {nbytes / 2**30:.1f} GiB"
        raise ValueError(
            f"{what} does not fit in the {available / 2**30:.1f} GiB of memory available; "
            "give a smaller --kv-cache-size"
        )


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux's MemAvailable), else the
    machine's physical memory, else None (unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
