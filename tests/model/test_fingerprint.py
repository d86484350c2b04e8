"""Content fingerprints of checkpoints (app.model.fingerprint)."""

import mmap

import numpy as np
from gguf import GGUFReader, GGUFWriter

from app.model.fingerprint import WINDOW_BYTES, WINDOWS, _gguf_data_offset, fingerprint


def write_gguf(path, alignment: int | None = None, fill: float = 0.0, name: str = "a"):
    writer = GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_name(name)
    writer.add_array("tokenizer.ggml.tokens", ["x", "yy", "zzz"])
    # Tensor data well beyond the sampled windows, so that sampling is what runs.
    writer.add_tensor("big", np.full(WINDOWS * WINDOW_BYTES, fill, dtype=np.float32))
    writer.add_tensor("small", np.arange(7, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_data_offset_agrees_with_the_gguf_package(tmp_path):
    for alignment in (None, 64, 4096):
        path = write_gguf(tmp_path / f"{alignment}.gguf", alignment)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            assert _gguf_data_offset(m) == GGUFReader(str(path)).data_offset


def test_fingerprint_sees_metadata_and_data_but_not_names(tmp_path):
    base = fingerprint(write_gguf(tmp_path / "a.gguf"))
    (tmp_path / "elsewhere").mkdir()
    assert fingerprint(write_gguf(tmp_path / "elsewhere" / "b.gguf")) == base
    assert fingerprint(write_gguf(tmp_path / "c.gguf", name="other")) != base
    assert fingerprint(write_gguf(tmp_path / "d.gguf", fill=1.0)) != base
