"""The weights a step reads, moved into one block of memory, on 2 MiB pages where the OS
gives them.

A decode step reads every weight once: ~100 MB for the default model, ~0.8 GB at a 1B
shape. Loaded the usual way they lie in separate allocations on 4 KiB pages, so each step
misses the TLB once a page (25,000 page walks a step at 100 MB) and the hardware
prefetcher stops at every page boundary. Here they are copied, each contiguous, into one
anonymous private mapping asked for transparent huge pages (madvise(MADV_HUGEPAGE)): one
TLB entry per 2 MiB. Measured (bench/README.md, "The weights in one block"): a decode
step of the default model 6.63 -> 6.05 ms, of the 1B shape 33.5 -> 31.6 ms, the same bits
(the bytes are copied, not changed).

Only plain CPU tensors that own their storage move: oneDNN's packed weights and other
opaque layouts stay where they are, and so does anything small (norms). A tensor held in
two places (a tied embedding's and LM head's TiledGroupWeight) is moved once and every
holder gets the moved one, so nothing is kept twice.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

MIN_BYTES = 4 << 10  # smaller tensors (a norm's weights) stay where they are
ALIGN = 64  # each tensor starts on a cache line
TRIM_BYTES = 64 << 20  # moved between two returns of the freed originals to the OS
HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclasses.dataclass
class WeightArena:
    """The mapping the moved weights live in (kept alive by the model that holds it)."""

    memory: mmap.mmap
    nbytes: int  # bytes of weights moved in
    tensors: int
    huge_pages: str  # what the OS was asked for and says it does, for the start-up log


def gather(model: nn.Module) -> WeightArena | None:
    """Move `model`'s large weights into one arena, in the order its modules list them
    (embedding, layers in order, LM head: the order a step reads them). Returns the
    arena (also set as model.weight_arena), or None when there is nothing to move or
    PARLEY_WEIGHT_ARENA=0 leaves the weights where they were loaded."""
    if os.environ.get("PARLEY_WEIGHT_ARENA", "1") == "0":
        return None
    # Per tensor (by address: one held in two places moves once), where it is held and
    # as what; the tensors themselves only in `originals`, so that each is freed as soon
    # as it is moved and the peak stays near the weights' size.
    held: dict[int, list[tuple[Any, str, torch.dtype, torch.Size]]] = {}
    originals: dict[int, torch.Tensor] = {}
    for obj, name, t in _holders(model):
        held.setdefault(t.data_ptr(), []).append((obj, name, t.dtype, t.shape))
        originals.setdefault(t.data_ptr(), t)
    if not originals:
        return None
    padded = lambda t: -(-t.nbytes // ALIGN) * ALIGN  # noqa: E731
    # A 2 MiB-aligned start within the mapping: a huge page needs an aligned virtual range.
    size = sum(map(padded, originals.values())) + HUGE_PAGE
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    asked = _ask_for_huge_pages(memory)
    block = torch.frombuffer(memory, dtype=torch.uint8)
    at = -block.data_ptr() % HUGE_PAGE
    count, nbytes, trimmed_at = len(originals), 0, 0
    with torch.no_grad():
        for ptr, places in held.items():
            t = originals.pop(ptr)
            raw = block[at : at + t.nbytes]
            raw.view(t.dtype).view(t.shape).copy_(t)
            nbytes += t.nbytes
            at += padded(t)
            del t
            for obj, name, dtype, shape in places:  # each holder sees it as it saw it
                _set(obj, name, raw.view(dtype).view(shape))
            if nbytes - trimmed_at >= TRIM_BYTES:  # the freed originals back to the OS
                _return_freed_memory()
                trimmed_at = nbytes
    _return_freed_memory()
    arena = WeightArena(memory, nbytes, count, _pages(asked))
    model.weight_arena = arena
    return arena


def _holders(model: nn.Module) -> Iterator[tuple[Any, str, torch.Tensor]]:
    """(object, attribute, tensor) for every weight worth moving: a module's tensors,
    parameters and buffers, and the tensors of the quantized-weight records it holds
    (Int4Weight, GroupWeight, TiledGroupWeight, Q8Weight: dataclasses of tensors)."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if _movable(value):
                yield module, name, value
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                for field in dataclasses.fields(value):
                    inner = getattr(value, field.name)
                    if _movable(inner):
                        yield value, field.name, inner
        for store in (module._parameters, module._buffers):
            for name, value in store.items():
                if _movable(value):
                    yield store, name, value


def _ask_for_huge_pages(memory: mmap.mmap) -> bool:
    """madvise(MADV_HUGEPAGE) on the mapping; False where the OS has no such advice (not
    Linux, or a kernel built without transparent huge pages: EINVAL)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return False
    return True


def _return_freed_memory() -> None:
    """Hand the originals' freed pages back to the OS: glibc keeps freed heap memory for
    later allocations (the process's RSS would grow by the weights moved) unless asked."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):  # not glibc: nothing to ask
        pass


def _movable(t: object) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.nbytes  # owns its storage: not a view
        and t.nbytes >= MIN_BYTES
    )


def _set(obj: Any, name: str, t: torch.Tensor) -> None:
    if isinstance(obj, dict):  # a module's _parameters or _buffers
        old = obj[name]
        if isinstance(old, nn.Parameter):
            old.data = t
        else:
            obj[name] = t
    else:
        setattr(obj, name, t)


def _pages(asked: bool) -> str:
    """What the OS does with the request, in words."""
    if not asked:
        return "4 KiB pages (the OS has no transparent huge pages to ask for)"
    try:
        setting = THP_SETTING.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "2 MiB pages asked for (transparent huge pages)"
    if setting == "never":
        return f"4 KiB pages (transparent huge pages are off: echo madvise > {THP_SETTING})"
    return f"2 MiB pages (transparent huge pages: {setting})"
