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


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that decides the bytes of a block's K/V. The device is left out on
    purpose: K/V computed on another device or CPU differ only in the last bits, like a
    batch of another size."""

    weights: str  # weights_digest()
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
