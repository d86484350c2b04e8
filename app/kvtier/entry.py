"""The entry format: one block's K/V for every layer, with a header that says whose it is.

    header  magic "PKVB", version, dtype, rank, flags, model fingerprint (16 bytes),
            block key (16 bytes), payload length, CRC-32 of the payload, shape
    payload the block's K/V, (layers, 2, block_size, kv_heads, head_dim), raw bytes

Flags: WINDOWED, the block's K/V in the local (sliding-window) layers was given back
before it was stored (KVCache.release_local): those layers' part is zeros, and whoever
loads it marks the block so (KVCacheManager uses it only where no window reaches it).

A reader checks all of it before a byte reaches the cache: another model's entry, an entry
under the wrong key, a short one or a flipped bit each raise BadEntry with a reason, and
the caller recomputes. CRC-32 catches accidents (4 GB/s here, against blake2b's 0.8), not
an attacker: whoever can write to the tier can change replies, so it is secured like the
conversations' text (see docs/kv_tier.md).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"PKVB"
VERSION = 2  # 2: the flags byte
_HEAD = struct.Struct("<4sHBBB16s16sQI")
WINDOWED = 1
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int8: 4}


class BadEntry(ValueError):
    """An entry that must not be used. `reason`: format, foreign, truncated, checksum."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class EntryLayout:
    """What every entry of one model looks like."""

    fingerprint: bytes  # ModelFingerprint.digest
    dtype: torch.dtype
    shape: tuple[int, ...]  # one block: (layers, 2, block_size, kv_heads, head_dim)

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    @property
    def header_bytes(self) -> int:
        return _HEAD.size + 4 * len(self.shape)

    @property
    def entry_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes


def encode(layout: EntryLayout, key: bytes, block: torch.Tensor, windowed: bool = False) -> bytes:
    """One entry from a block's K/V (a CPU tensor of layout.shape). One copy."""
    assert tuple(block.shape) == layout.shape and block.dtype == layout.dtype
    payload = block.contiguous().view(torch.uint8).reshape(-1).numpy()
    head = _HEAD.pack(
        MAGIC,
        VERSION,
        DTYPE_CODES[layout.dtype],
        len(layout.shape),
        WINDOWED if windowed else 0,
        layout.fingerprint,
        key,
        payload.nbytes,
        zlib.crc32(payload),
    )
    shape = struct.pack(f"<{len(layout.shape)}I", *layout.shape)
    return b"".join((head, shape, payload))


def decode_into(layout: EntryLayout, key: bytes, data: bytes, out: torch.Tensor) -> bool:
    """Check an entry and copy its payload into `out` (contiguous, CPU, layout.shape);
    returns whether it is WINDOWED. Raises BadEntry; `out` is then unspecified."""
    if len(data) < _HEAD.size:
        raise BadEntry("truncated", f"entry of {len(data)} bytes: shorter than its header")
    magic, version, dtype, rank, flags, fingerprint, entry_key, size, crc = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise BadEntry("format", f"not a version {VERSION} entry (magic {magic!r}, v{version})")
    if fingerprint != layout.fingerprint or entry_key != key:
        raise BadEntry("foreign", "entry of another model or under another key")
    if len(data) < _HEAD.size + 4 * rank:
        raise BadEntry("truncated", "entry cut inside its header")
    shape = struct.unpack_from(f"<{rank}I", data, _HEAD.size)
    if dtype != DTYPE_CODES.get(layout.dtype) or shape != layout.shape:
        raise BadEntry("foreign", f"entry of shape {shape}, dtype code {dtype}")
    start = _HEAD.size + 4 * rank
    if size != layout.payload_bytes or len(data) != start + size:
        raise BadEntry("truncated", f"payload of {len(data) - start} bytes, expected {size}")
    payload = np.frombuffer(data, np.uint8, count=size, offset=start)
    if zlib.crc32(payload) != crc:
        raise BadEntry("checksum", "payload checksum mismatch")
    np.copyto(out.view(torch.uint8).reshape(-1).numpy(), payload)
    return bool(flags & WINDOWED)
