"""Q8_0 as stored (app.model.quant.q8_0) and the LM head's kernel, parley.block_matmul: the
GGUF's own weights bit for bit, and a logit whose bits depend on its row alone."""

import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from gguf.quants import dequantize, quantize

from app.config import default_cache_dir
from app.model import kernels
from app.model.quant.q8_0 import BlockLinear, Q8Embedding, Q8Weight, from_gguf_q8_0


@pytest.fixture(scope="module", autouse=True)
def parley_kernels():
    why = kernels.load(default_cache_dir())
    if why is not None:
        pytest.skip(why)


def q8_weight(n: int, k: int, seed: int = 0) -> tuple[Q8Weight, torch.Tensor]:
    """A weight quantized by gguf itself, and gguf's dequantized floats of it."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    raw = quantize(w.numpy(), GGML.Q8_0)
    return from_gguf_q8_0(raw), torch.from_numpy(dequantize(raw, GGML.Q8_0))


def test_q8_0_blocks_are_read_as_gguf_dequantizes_them():
    weight, want = q8_weight(48, 96)
    assert weight.codes.dtype == torch.int8 and weight.scale.shape == (48, 3)
    assert torch.equal(weight.dequantize(), want)
    ids = torch.tensor([5, 0, 47, 5])
    assert torch.equal(weight.rows(ids), want[ids])
    table = Q8Embedding(weight, torch.bfloat16)(ids)
    assert table.dtype == torch.bfloat16 and torch.equal(table, want[ids].bfloat16())


@pytest.mark.parametrize("kind", ["q8_0", "bfloat16", "float32"])
def test_block_matmul_computes_x_w_t(kind):
    weight, floats = q8_weight(200, 576)
    head = BlockLinear(weight if kind == "q8_0" else floats.to(getattr(torch, kind)))
    exact = floats if kind == "q8_0" else floats.to(getattr(torch, kind)).double()
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = head(x)
    want = x.double() @ exact.double().t()
    assert y.dtype == torch.float32 and y.shape == (7, 200)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(head(x.float()), y)  # bf16 activations are widened exactly


def test_a_logit_has_the_same_bits_in_any_batch_on_any_thread_count():
    """Each output element is the same instructions in the same order, whatever the rows
    around it, the tile it falls in or the thread that computes it."""
    weight, _ = q8_weight(203, 576, seed=2)  # 203: tiles of 4 with a ragged last one
    head = BlockLinear(weight)
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    whole = head(x)
    for i in range(37):
        assert torch.equal(head(x[i : i + 1]), whole[i : i + 1]), i
    assert torch.equal(head(x[5:16]), whole[5:16])
    assert torch.equal(head(x[10:12]), whole[10:12])  # fewer rows than a tile: 2-row tiles
    assert torch.equal(head(x[20:23]), whole[20:23])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(head(x), whole), n
    finally:
        torch.set_num_threads(threads)


def test_block_matmul_refuses_what_it_cannot_compute():
    weight, _ = q8_weight(16, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.parley.block_matmul(torch.randn(2, 48), torch.zeros(16, 48), None)
    with pytest.raises(RuntimeError, match="scales go with int8"):
        torch.ops.parley.block_matmul(torch.randn(2, 64), weight.codes, None)
    with pytest.raises(RuntimeError, match=r"x \(M, K\) and weight \(N, K\)"):
        torch.ops.parley.block_matmul(torch.randn(2, 32), weight.codes, weight.scale)


def test_the_default_model_serves_its_embedding_and_head_from_q8_0(smollm):
    """One copy of the file's Q8_0 bytes serves the embedding and the tied head: on
    group_matmul, tiled, with bf16 activations; on block_matmul with fp32 ones (a CPU
    without native bf16), which that kernel keeps exact."""
    from app.config import ModelConfig
    from app.model.build import build_model
    from app.model.gguf_file import iter_q8_weights, open_gguf
    from app.model.quant.kquants import GroupEmbedding, GroupLinear, int8_head_fits

    built = build_model(smollm, ModelConfig(), "cpu", 512)
    model = built.model
    reader, arch = open_gguf(smollm.source)
    stored = dict(iter_q8_weights(reader, arch))["model.embed_tokens.weight"]
    head = model.packed_lm_head
    ids = torch.tensor([0, 17, 15, 49151, 300])
    if built.format.dtype == "bfloat16":
        assert isinstance(head, GroupLinear) and head.tiled.bits == 8
        # x as 8-bit codes on q8_matmul where the kernels have AVX-512 VNNI
        assert head.int8_x == int8_head_fits(head.tiled)
        assert ("q8_matmul" in repr(head)) == head.int8_x
        assert isinstance(model.embed_tokens, GroupEmbedding)
        assert model.embed_tokens.gw is head.tiled  # one copy
        # The head reads the GGUF's bytes: its rows are the file's Q8_0 token embedding.
        assert torch.equal(head.tiled.row_codes(ids), stored.codes[ids].to(torch.int16))
        assert torch.equal(head.tiled.rows_of(ids), stored.rows(ids))
    else:
        assert isinstance(model.embed_tokens, Q8Embedding)
        assert isinstance(head, BlockLinear) and head.scale is not None
        assert model.embed_tokens.q8.codes.data_ptr() == head.weight.data_ptr()
        assert torch.equal(stored.codes, head.weight) and torch.equal(stored.scale, head.scale)
    # ~30 MB for both, where bf16 took ~57 MB twice.
    assert built.weight_bytes < 110e6
