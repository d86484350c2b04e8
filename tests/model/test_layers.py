"""The decoder's small layers, written for few tensor ops, against their textbook forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.model.llama import RMSNorm, Rotary, rotary_inv_freq
from tests.tiny import tiny_arch


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rmsnorm_equals_the_formula(rows):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x = torch.randn(rows, 576, generator=g) * 3
    x[0] *= 1e-4  # a row so small that eps matters
    expected = F.rms_norm(x.double(), (576,), norm.weight.double(), 1e-5)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-6, atol=1e-7)


def test_rmsnorm_rows_do_not_depend_on_their_batch():
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    x = torch.randn(64, 576, generator=g).to(torch.bfloat16)
    alone = torch.cat([norm(x[i : i + 1]) for i in range(64)])
    assert torch.equal(norm(x), alone)


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
