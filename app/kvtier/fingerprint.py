"""The model fingerprint: an entry is valid only for the model, dtype and layout that
wrote it. Two processes that load the same weights compute the same fingerprint wherever
the file lies, so they share entries (a conversation moving between replicas through
Redis); any other difference makes the entries invisible to each other."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

# Bump when the entry format or the paged K/V layout changes: old entries stop matching.
LAYOUT_VERSION = 1


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """The weights' identity from their content (names, shapes, dtypes and a CRC of every
    byte), not from a path or a modification time. ~0.15 s for 540 MB."""
    h = hashlib.blake2b(digest_size=16, person=b"parley-weights")
    for name in sorted(weights):
        t = weights[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.reshape(-1).contiguous().cpu()
        if flat.numel():
            h.update(zlib.crc32(flat.view(torch.uint8).numpy()).to_bytes(4, "little"))
    return h.hexdigest()


def checkpoint_digest(path: Path) -> str:
    """The identity of a checkpoint on disk from every byte of its weights: a GGUF file, or
    a Hugging Face folder's safetensors and JSON files (names, sizes, content). Read in
    chunks, not mapped: digesting the loaded tensors instead pages the whole dequantized
    copy into the process (~540 MB of the default model's, which int4 weights never
    read), and the server's peak memory at start-up was that."""
    h = hashlib.blake2b(digest_size=16, person=b"parley-weights")
    files = (
        [path]
        if path.is_file()
        else sorted(path.glob("*.safetensors")) + sorted(path.glob("*.json"))
    )
    buf = bytearray(1 << 20)
    for f in files:
        name = "" if f == path else f.name  # a file's own name or place is not its identity
        h.update(f"{name}|{f.stat().st_size}|".encode())
        with open(f, "rb", buffering=0) as src:
            while n := src.readinto(buf):
                h.update(memoryview(buf)[:n])
    return h.hexdigest()


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that decides the bytes of a block's K/V. The device is left out on
    purpose: K/V computed on another device or CPU differ only in the last bits, like a
    batch of another size."""

    weights: str  # checkpoint_digest(), or weights_digest() for weights with no file
    arch: str  # the architecture config (rope, heads, ...): same weights, other K/V
    dtype: str
    quantization: str
    block_size: int
    layout_version: int = LAYOUT_VERSION

    @cached_property
    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=16, person=b"parley-kvtier")
        h.update(repr(self).encode())
        return h.digest()

    @property
    def hex(self) -> str:
        return self.digest.hex()
