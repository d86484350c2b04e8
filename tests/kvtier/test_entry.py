"""The entry format and the model fingerprint: whatever is wrong with an entry, it never
reaches the cache."""

import pytest
import torch

from app.kvtier.entry import BadEntry, EntryLayout, decode_into, encode
from app.kvtier.fingerprint import ModelFingerprint, checkpoint_digest, weights_digest

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, kv_heads, head_dim
KEY = bytes(range(16))


def layout(fingerprint: bytes = b"f" * 16, dtype: torch.dtype = torch.float32) -> EntryLayout:
    return EntryLayout(fingerprint, dtype, SHAPE)


def block(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def decoded(lay: EntryLayout, data: bytes, key: bytes = KEY) -> torch.Tensor:
    out = torch.empty(lay.shape, dtype=lay.dtype)
    decode_into(lay, key, data, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype):
    lay = layout(dtype=dtype)
    b = block(1, dtype)
    data = encode(lay, KEY, b)
    assert len(data) == lay.entry_bytes
    assert torch.equal(decoded(lay, data).view(torch.uint8), b.view(torch.uint8))


def test_an_entry_says_whether_its_local_layers_were_given_back():
    lay, b = layout(), block(2)
    out = torch.empty(lay.shape, dtype=lay.dtype)
    assert decode_into(lay, KEY, encode(lay, KEY, b, windowed=True), out) is True
    assert torch.equal(out, b)
    assert decode_into(lay, KEY, encode(lay, KEY, b), out) is False


def test_a_non_contiguous_block_is_stored_as_its_values():
    layers, kv, *rest = SHAPE
    cache = torch.randn(layers, kv, 3, *rest)  # the cache's block dimension sits inside
    b = cache[:, :, 1]
    assert not b.is_contiguous()
    assert torch.equal(decoded(layout(), encode(layout(), KEY, b)), b)


def reason(lay: EntryLayout, data: bytes, key: bytes = KEY) -> str:
    with pytest.raises(BadEntry) as info:
        decoded(lay, data, key)
    return info.value.reason


def test_a_flipped_bit_fails_the_checksum():
    data = bytearray(encode(layout(), KEY, block()))
    data[-100] ^= 0x04
    assert reason(layout(), bytes(data)) == "checksum"


def test_short_entries_are_truncated():
    data = encode(layout(), KEY, block())
    assert reason(layout(), data[:-1]) == "truncated"
    assert reason(layout(), data[:10]) == "truncated"
    assert reason(layout(), data + b"x") == "truncated"


def test_another_model_or_key_or_shape_is_foreign():
    data = encode(layout(), KEY, block())
    assert reason(layout(b"g" * 16), data) == "foreign"
    assert reason(layout(), data, key=b"k" * 16) == "foreign"
    assert reason(EntryLayout(b"f" * 16, torch.float32, (2, 2, 4, 2, 4)), data) == "foreign"
    assert reason(layout(dtype=torch.bfloat16), data) == "foreign"


def test_garbage_is_not_an_entry():
    assert reason(layout(), b"\0" * 5000) == "format"


def fingerprint(weights, **kw) -> ModelFingerprint:
    fields = dict(arch="tiny", dtype="float32", quantization="none", block_size=16)
    fields.update(kw)
    return ModelFingerprint(weights_digest(weights), **fields)


def test_the_fingerprint_follows_the_weights_content_and_the_settings():
    w = {"a": torch.ones(4, 4), "b": torch.zeros(3)}
    same = {"b": torch.zeros(3), "a": torch.ones(4, 4)}  # another dict, same content
    assert fingerprint(w).digest == fingerprint(same).digest
    changed = {"a": torch.ones(4, 4), "b": torch.tensor([0.0, 0.0, 1e-7])}
    assert fingerprint(w).digest != fingerprint(changed).digest
    assert fingerprint(w).digest != fingerprint(w, dtype="bfloat16").digest
    assert fingerprint(w).digest != fingerprint(w, quantization="int8").digest
    assert fingerprint(w).digest != fingerprint(w, block_size=32).digest
    assert fingerprint(w).digest != fingerprint(w, arch="tiny, rope 1e6").digest
    assert fingerprint(w).digest != fingerprint(w, layout_version=99).digest
    assert len(fingerprint(w).hex) == 32


def test_a_checkpoint_on_disk_is_known_by_every_byte_of_its_weights(tmp_path):
    """The served model's identity is its file's content, wherever the file lies; a folder's
    weights and config count, other files in it do not."""
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
        (d / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
        (d / "config.json").write_text('{"hidden_size": 8}')
    (two / "README.md").write_text("not the weights")
    assert checkpoint_digest(one) == checkpoint_digest(two)
    data = bytearray((two / "model.safetensors").read_bytes())
    data[700_000] ^= 1  # one bit, deep inside
    (two / "model.safetensors").write_bytes(bytes(data))
    assert checkpoint_digest(one) != checkpoint_digest(two)
    (one / "config.json").write_text('{"hidden_size": 9}')
    assert checkpoint_digest(one) != checkpoint_digest(one / "model.safetensors")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    moved = tmp_path / "elsewhere.gguf"
    moved.write_bytes(gguf.read_bytes())
    assert checkpoint_digest(gguf) != checkpoint_digest(one)
    assert checkpoint_digest(gguf) == checkpoint_digest(moved)  # another name, same bytes
