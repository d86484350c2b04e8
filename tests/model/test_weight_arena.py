"""The weights moved into one block (app/model/weight_arena.py): the same bits from the
moved bytes, every holder of a shared tensor sees the one copy, nothing is kept twice,
and the real model's weights land there, on huge pages where the OS gives them."""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import tests.tiny
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.model import weight_arena
from app.model.quant.int4 import Int4Linear
from tests.tiny import tiny_engine

PROMPTS = [[5, 9, 13, 200, 17], [40, 41, 42], [7] * 20]


def arena_start(arena: weight_arena.WeightArena) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(arena.memory))


def in_arena(t: torch.Tensor, arena: weight_arena.WeightArena) -> bool:
    start = arena_start(arena)
    return start <= t.data_ptr() < start + len(arena.memory)


def greedy(engine) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy reply and its logprobs, the prompts batched."""
    ids = []
    for prompt in PROMPTS:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
        ids.append(engine.add_request(EngineRequest(prompt, params)).request_id)
    got: dict[str, tuple[list[int], list[float]]] = {i: ([], []) for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(lp.logprob for lp in out.logprobs or [])
    return [got[i] for i in ids]


@pytest.mark.parametrize("quantization, dtype", [("int4", "bfloat16"), ("none", "float32")])
def test_a_model_in_the_arena_gives_the_same_bits(tokenizer, monkeypatch, quantization, dtype):
    monkeypatch.setattr(tests.tiny, "QUANTIZATION", quantization)
    monkeypatch.setattr(tests.tiny, "DTYPE", dtype)
    monkeypatch.setattr(weight_arena, "MIN_BYTES", 1 << 40)  # the tiny model's stay put
    where_they_were = tiny_engine(tokenizer)
    assert getattr(where_they_were.model, "weight_arena", None) is None
    monkeypatch.setattr(weight_arena, "MIN_BYTES", 0)  # every tensor moves
    moved = tiny_engine(tokenizer)
    arena = moved.model.weight_arena
    assert arena.tensors > 0
    if quantization == "int4":
        lin = moved.model.layers[0].down
        assert isinstance(lin, Int4Linear)
        assert all(in_arena(t, arena) for t in (lin.codes, lin.d, lin.m))
    assert greedy(moved) == greedy(where_they_were)


def test_a_shared_tensor_moves_once_and_every_holder_sees_it():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(512, 256)
            self.head = nn.Linear(256, 512, bias=False)
            self.head.weight = self.embed.weight  # tied, as a model's LM head
            self.codes = torch.arange(1 << 17, dtype=torch.int32)  # a plain attribute
            self.register_buffer("table", torch.randn(200, 100))

    model = Tied()
    x = torch.randn(3, 256)
    want = model.head(x), model.embed(torch.tensor([1, 7])), model.codes.clone()
    original = weakref.ref(model.embed.weight.data)
    arena = weight_arena.gather(model)
    assert arena is not None and arena.tensors == 3  # weight (once), codes, table
    assert isinstance(model.head.weight, nn.Parameter)
    assert model.head.weight is model.embed.weight
    assert all(in_arena(t, arena) for t in (model.embed.weight, model.codes, model.table))
    assert torch.equal(model.head(x), want[0])
    assert torch.equal(model.embed(torch.tensor([1, 7])), want[1])
    assert torch.equal(model.codes, want[2])
    assert original() is None  # the old copy was freed, not kept beside the new one
    assert weight_arena.gather(model) is None  # moved tensors are views: nothing to move


def test_the_real_models_weights_are_in_one_block(smollm):
    from app.config import ModelConfig
    from app.model.build import build_model

    built = build_model(smollm, ModelConfig(quantization="int4"), "cpu", 512)
    arena = built.model.weight_arena
    # Everything a decode step reads but the norms (the layers' codes and scales, the head)
    assert arena.nbytes > 0.95 * built.weight_bytes
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("transparent huge pages are off here: the block is on 4 KiB pages")
    assert "2 MiB pages" in arena.huge_pages
    start = arena_start(arena)
    eligible = None
    for vma in Path("/proc/self/smaps").read_text().split("\n")[:-1]:
        head = vma.split()[0] if vma else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= start < hi
        elif inside and vma.startswith("THPeligible:"):
            eligible = vma.split()[1]
    assert eligible == "1"  # the kernel may back it with 2 MiB pages


def test_an_os_without_huge_pages_still_gets_one_block(monkeypatch):
    class NoAdvice:  # a kernel without transparent huge pages refuses the advice
        def madvise(self, advice: int) -> None:
            raise OSError(22, "Invalid argument")

    assert weight_arena._ask_for_huge_pages(NoAdvice()) is False
    monkeypatch.setattr(weight_arena, "_ask_for_huge_pages", lambda memory: False)
    model = nn.Linear(256, 256)
    x = torch.randn(2, 256)
    want = model(x)
    arena = weight_arena.gather(model)
    assert arena.huge_pages.startswith("4 KiB pages")
    assert in_arena(model.weight, arena)
    assert torch.equal(model(x), want)


def test_parley_weight_arena_0_leaves_the_weights_where_they_are(monkeypatch):
    monkeypatch.setenv("PARLEY_WEIGHT_ARENA", "0")
    model = nn.Linear(256, 256)
    where = model.weight.data_ptr()
    assert weight_arena.gather(model) is None
    assert model.weight.data_ptr() == where
