"""A checkpoint's content fingerprint: what names the files derived from it in the cache
(converted weights, tokenizer, int8 and int4 weights).

A name, size or modification time says little about content (two downloads named
`model.gguf` of one size hold different weights), and hashing every byte of a multi-GB file
on each start is slow. So the fingerprint hashes every byte that describes the weights (a
GGUF's header and tensor table, metadata and tokenizer included; a safetensors file's
header; a folder's JSON files) and, of the tensor data itself, evenly spaced windows:
~2 MiB read however large the file. Two checkpoints that differ only between the windows
would collide; re-quantized, fine-tuned or re-converted weights differ everywhere.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Callable
from pathlib import Path

WINDOWS = 32
WINDOW_BYTES = 64 << 10
GGUF_DEFAULT_ALIGNMENT = 32

# GGUF value types with a fixed size (the rest: 8 string, 9 array).
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4


def fingerprint(path: Path) -> str:
    """Hex digest of a GGUF file, a safetensors file, or a Hugging Face folder."""
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(path.iterdir()):
            if f.suffix == ".json":
                h.update(f"{f.name}\0".encode())
                h.update(f.read_bytes())
            elif f.suffix == ".safetensors":
                h.update(f"{f.name}\0".encode())
                _hash_file(h, f, _safetensors_data_offset)
    elif path.suffix == ".gguf":
        _hash_file(h, path, _gguf_data_offset)
    else:
        _hash_file(h, path, _safetensors_data_offset)
    return h.hexdigest()


def _hash_file(h: hashlib._Hash, path: Path, data_offset: Callable[[mmap.mmap], int]) -> None:
    size = path.stat().st_size
    h.update(size.to_bytes(8, "little"))
    if size == 0:
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        start = data_offset(m)
        h.update(m[:start])
        data = size - start
        if data <= WINDOWS * WINDOW_BYTES:
            h.update(m[start:])
            return
        step = (data - WINDOW_BYTES) // (WINDOWS - 1)  # first window at the start, last at the end
        for i in range(WINDOWS):
            at = start + i * step
            h.update(m[at : at + WINDOW_BYTES])


def _safetensors_data_offset(m: mmap.mmap) -> int:
    """A safetensors file: an 8-byte length, that many bytes of JSON header, the data."""
    if len(m) < 8:
        return len(m)
    (n,) = struct.unpack_from("<Q", m, 0)
    return min(8 + n, len(m))


def _gguf_data_offset(m: mmap.mmap) -> int:
    """Where a GGUF file's tensor data starts: after the header, the key-value metadata and
    the tensor table, aligned (general.alignment, 32 by default). Walked here rather than
    with gguf.GGUFReader, which builds every tokenizer string (~2 s for a 49k vocabulary)."""
    if m[:4] != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    pos = 8  # magic, version
    n_tensors, n_kv = struct.unpack_from("<QQ", m, pos)
    pos += 16
    alignment = GGUF_DEFAULT_ALIGNMENT

    def string(at: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", m, at)
        return m[at + 8 : at + 8 + n], at + 8 + n

    def skip_value(kind: int, at: int) -> int:
        if kind == _GGUF_STRING:
            return string(at)[1]
        if kind == _GGUF_ARRAY:
            item, count = struct.unpack_from("<IQ", m, at)
            at += 12
            if item in _GGUF_SIZES:
                return at + count * _GGUF_SIZES[item]
            for _ in range(count):
                at = skip_value(item, at)
            return at
        return at + _GGUF_SIZES[kind]

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", m, pos)
        pos += 4
        if key == b"general.alignment" and kind == _GGUF_UINT32:
            (alignment,) = struct.unpack_from("<I", m, pos)
        pos = skip_value(kind, pos)
    for _ in range(n_tensors):
        _, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", m, pos)
        pos += 4 + 8 * n_dims + 4 + 8  # dims, type, offset
    return min(-(-pos // alignment) * alignment, len(m))
