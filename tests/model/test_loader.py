"""The converted-weights cache and the cache key of derived weights follow a checkpoint's
content, not its name, size or path."""

import shutil

import pytest
import torch

from app.config import ModelConfig, default_cache_dir
from app.model.loader import load_model
from app.model.registry import default_model_path
from tests.model.gguf_export import write_llama_gguf
from tests.tiny import tiny_hf_llama3

pytest.importorskip("transformers")


def test_same_name_and_size_but_other_weights_load_their_own(tmp_path, tokenizer):
    source = default_model_path(default_cache_dir())
    paths = []
    for seed in (0, 1):
        folder = tmp_path / f"download-{seed}"
        folder.mkdir()
        hf = tiny_hf_llama3(len(tokenizer), seed)
        paths.append(write_llama_gguf(hf, folder / "model.gguf", source))
    assert paths[0].stat().st_size == paths[1].stat().st_size
    cache = tmp_path / "cache"
    first, second = (load_model(ModelConfig(model=str(p), cache_dir=cache)) for p in paths)
    name = "layers.0.qkv.weight"
    assert not torch.equal(first.weights[name], second.weights[name])
    assert first.cache_key != second.cache_key  # the int8 cache is named by it
    # and each is what a cold load of its own file gives
    alone = load_model(ModelConfig(model=str(paths[1]), cache_dir=tmp_path / "fresh"))
    assert torch.equal(second.weights[name], alone.weights[name])


def test_hf_folder_cache_key_follows_content(tmp_path, tokenizer):
    hf = tiny_hf_llama3(len(tokenizer))
    # Same folder name, so that only content can tell them apart (the name is a readable
    # prefix of the key).
    a, copy, other = (tmp_path / d / "model" for d in ("a", "copy", "other"))
    hf.save_pretrained(a)
    tokenizer.save_pretrained(a)
    shutil.copytree(a, copy)
    tiny_hf_llama3(len(tokenizer), seed=1).save_pretrained(other)
    tokenizer.save_pretrained(other)
    key = {
        p: load_model(ModelConfig(model=str(p), cache_dir=tmp_path)).cache_key
        for p in (a, copy, other)
    }
    assert key[a] == key[copy]  # same bytes elsewhere: the derived weights are reusable
    assert key[a] != key[other]
