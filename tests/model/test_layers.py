"""The decoder's rotary embeddings, written for few tensor ops, against the textbook form."""

from __future__ import annotations

import pytest
import torch

from app.model.llama import Rotary, rotary_inv_freq
from tests.tiny import tiny_arch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_rotate_half_to_the_bit(dtype):
    arch = tiny_arch(32)
    rotary = Rotary(arch, 256).to(dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 6, arch.head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 64, 100, 101, 200, 255])
    # Hugging Face's form: x * cos + rotate_half(x) * sin, written out per half.
    freqs = torch.outer(positions.double(), rotary_inv_freq(arch))
    cos = freqs.cos().float().to(dtype)[:, None, :]
    sin = freqs.sin().float().to(dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    assert torch.equal(Rotary.rotate(x, rotary.at(positions)), expected)
