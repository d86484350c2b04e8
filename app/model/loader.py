"""Weights and tokenizer: from a local Hugging Face folder or a GGUF file, into the
parameter layout of `app.model.llama` (Q/K/V fused into one matrix, gate/up into another).

Dequantizing a GGUF file takes seconds, so the result is kept in the cache directory as
safetensors next to the tokenizer; a warm start only maps that file.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.config import ModelConfig
from app.model.arch import ArchConfig
from app.model.families import layer_norms
from app.model.fingerprint import fingerprint
from app.model.registry import DEFAULT_MODEL, MODELS, known_model, model_path

log = logging.getLogger(__name__)

# Bump when the converted layout changes (v2: rope_freqs in arch.json; v3: tensor_types.json;
# v4: the families' norms).
CACHE_FORMAT = "v4"
# End-of-turn markers of common chat templates: generation stops at any that exists.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass
class LoadedModel:
    """What the engine needs from a checkpoint."""

    name: str
    arch: ArchConfig
    weights: dict[str, torch.Tensor]  # names of app.model.llama.LlamaModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    # Names files derived from these weights in the cache (int8, int4): the checkpoint's
    # name, for people, and its content fingerprint, for correctness.
    cache_key: str | None = None
    # Where the weights came from, and how each (Hugging Face name) was stored there:
    # a GGUF's types ("Q4_1", "Q8_0", "F32"); empty for floats (an HF folder, a test).
    source: Path | None = None
    tensor_types: dict[str, str] = field(default_factory=dict)

    def linear_types(self) -> set[str]:
        """How the checkpoint stores its linear layers' weights (norms and embedding aside)."""
        return {t for k, t in self.tensor_types.items() if k.endswith("_proj.weight")}


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load config, weights and tokenizer for `cfg.model` (None: the default model)."""
    known = known_model(cfg.model) if cfg.model is not None else DEFAULT_MODEL
    if known is not None and (cfg.model is None or not Path(cfg.model).expanduser().exists()):
        path = model_path(known, cfg.cache_dir)
        name = known.name
    else:
        path = Path(cfg.model).expanduser()
        name = path.stem if path.suffix == ".gguf" else path.name
        if not path.exists():
            raise FileNotFoundError(
                f"model path {path} does not exist (nor is it a known model name: "
                f"{', '.join(MODELS)})"
            )
    if not path.is_dir() and path.suffix != ".gguf":
        raise ValueError(f"{path} is neither a Hugging Face folder nor a .gguf file")
    key = f"{name}-{fingerprint(path)[:16]}"
    types: dict[str, str] = {}
    if path.is_dir():
        arch, weights, tokenizer = _load_hf_folder(path)
    else:
        converted = cfg.cache_dir / "converted" / f"{key}-{CACHE_FORMAT}"
        arch, weights, tokenizer = _load_gguf_cached(path, converted)
        types = json.loads((converted / "tensor_types.json").read_text())
    # Weights stay as loaded (fp32, memory-mapped): app.model.build converts what it keeps
    # into the dtype the model runs in, and leaves alone what a weight format replaces.
    if arch.architecture == "gemma3" and not getattr(tokenizer, "chat_template", None):
        from app.model.families.gemma3 import CHAT_TEMPLATE

        tokenizer.chat_template = CHAT_TEMPLATE
    eos = _eos_token_ids(tokenizer, path)
    return LoadedModel(name, arch, weights, tokenizer, eos, key, path, types)


def top_names(arch: ArchConfig) -> dict[str, str]:
    """The tensors outside the layers: Hugging Face name -> ours (a tied model has no head)."""
    names = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight"}
    if not arch.tie_word_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def fuse_top(name: str, tensor: torch.Tensor, arch: ArchConfig) -> tuple[str, torch.Tensor]:
    """One tensor of top_names in our name and form."""
    _, norm_offset = layer_norms(arch)
    if name == "model.norm.weight" and norm_offset:
        tensor = tensor + norm_offset
    return top_names(arch)[name], tensor


def layer_of(name: str) -> int | None:
    """The layer a Hugging Face tensor name belongs to (model.layers.12. ...), or None."""
    if not name.startswith("model.layers."):
        return None
    index = name.split(".", 3)[2]
    return int(index) if index.isdigit() else None


def fuse_layer(hf: dict[str, torch.Tensor], arch: ArchConfig, i: int) -> dict[str, torch.Tensor]:
    """Layer i's tensors, Hugging Face names -> ours (q, k, v and gate, up fused).
    Consumes them from `hf`."""
    norms, norm_offset = layer_norms(arch)
    p = f"model.layers.{i}."
    q = f"layers.{i}."
    out = {}
    for theirs, ours in norms.items():
        out[q + ours] = hf.pop(p + theirs) + norm_offset if norm_offset else hf.pop(p + theirs)
    fused = hf.pop(p + "self_attn.qkv_proj.weight", None)  # Phi-3 stores them so
    out[q + "qkv.weight"] = (
        torch.cat([hf.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"], dim=0)
        if fused is None
        else fused
    )
    if arch.attention_bias:
        out[q + "qkv.bias"] = torch.cat(
            [hf.pop(p + f"self_attn.{x}_proj.bias") for x in "qkv"], dim=0
        )
    out[q + "o_proj.weight"] = hf.pop(p + "self_attn.o_proj.weight")
    fused = hf.pop(p + "mlp.gate_up_proj.weight", None)
    out[q + "gate_up.weight"] = (
        torch.cat([hf.pop(p + "mlp.gate_proj.weight"), hf.pop(p + "mlp.up_proj.weight")])
        if fused is None
        else fused
    )
    out[q + "down.weight"] = hf.pop(p + "mlp.down_proj.weight")
    return out


def fuse_weights(hf: dict[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names -> ours. Consumes `hf` layer by layer to keep peak memory low."""
    if not arch.tie_word_embeddings and "lm_head.weight" not in hf:
        raise ValueError("the checkpoint has no lm_head.weight and does not tie embeddings")
    if arch.tie_word_embeddings:
        hf.pop("lm_head.weight", None)  # the embedding serves
    out = dict(fuse_top(name, hf.pop(name), arch) for name in top_names(arch))
    for i in range(arch.num_layers):
        out.update(fuse_layer(hf, arch, i))
    unused = [k for k in hf if "rotary_emb" not in k]
    if unused:
        log.warning("ignoring %d unexpected tensors, e.g. %s", len(unused), unused[:3])
    return out


def _load_hf_folder(path: Path) -> tuple[ArchConfig, dict[str, torch.Tensor], object]:
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    arch = ArchConfig.from_hf_config(json.loads(config_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                hf[key] = st.get_tensor(key).float()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return arch, fuse_weights(hf, arch), tokenizer


def _load_gguf_cached(path: Path, target: Path) -> tuple[ArchConfig, dict, object]:
    """`target`: the cache folder, named after the file's content (see fingerprint)."""
    if not (target / "arch.json").exists():
        _convert_gguf(path, target)
    arch = ArchConfig.from_dict(json.loads((target / "arch.json").read_text()))
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(target.glob("*.safetensors")):
        weights.update(read_tensors(shard))
    tokenizer = AutoTokenizer.from_pretrained(str(target / "tokenizer"))
    return arch, weights, tokenizer


def _convert_gguf(path: Path, target: Path) -> None:
    """Dequantize once and store our layout, a layer a file as each layer's last tensor
    arrives (so that memory holds one layer's fp32 weights, not the model's: a 1B model's
    first start peaked at 5.7 GiB when it held them all); atomic (a crash leaves no half
    cache)."""
    from app.model.gguf_file import hf_name, iter_tensors, open_gguf, tensor_types

    started = time.monotonic()
    reader, arch = open_gguf(path)
    names = [n for t in reader.tensors if (n := hf_name(t.name, arch.architecture))]
    if not arch.tie_word_embeddings and "lm_head.weight" not in names:
        raise ValueError("the checkpoint has no lm_head.weight and does not tie embeddings")
    per_layer = Counter(i for n in names if (i := layer_of(n)) is not None)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    types = tensor_types(reader, arch.architecture)

    def fill(tmp: Path) -> None:
        progress = tqdm(
            iter_tensors(reader, arch),
            total=len(reader.tensors),
            desc=f"Converting {path.name} (once)",
            unit="tensor",
            file=sys.stderr,
        )
        pending: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in progress:
            i = layer_of(name)
            if i is None:
                if name in top_names(arch):
                    ours, t = fuse_top(name, tensor, arch)
                    save_file({ours: t}, str(tmp / f"{ours}.safetensors"))
                elif "rotary_emb" not in name and name != "lm_head.weight":
                    log.warning("ignoring an unexpected tensor: %s", name)
                continue
            layer = pending.setdefault(i, {})
            layer[name] = tensor
            if len(layer) == per_layer[i]:
                del pending[i]
                fused = fuse_layer(layer, arch, i)
                if [k for k in layer if "rotary_emb" not in k]:
                    log.warning("ignoring unexpected tensors of layer %d: %s", i, list(layer))
                save_file(fused, str(tmp / f"layers.{i:04d}.safetensors"))
        (tmp / "arch.json").write_text(json.dumps(arch.to_dict(), indent=1))
        (tmp / "tensor_types.json").write_text(json.dumps(types, indent=1))
        tokenizer.save_pretrained(str(tmp / "tokenizer"))

    write_cache_dir(target, fill)
    log.info("converted %s in %.1f s into %s", path.name, time.monotonic() - started, target)


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file."""
    with safe_open(str(file), framework="pt") as st:
        return {key: st.get_tensor(key) for key in st.keys()}  # noqa: SIM118 - not a mapping


def write_cache_dir(target: Path, fill: Callable[[Path], None]) -> None:
    """Create the cache folder `target` atomically: `fill` writes into a temporary folder
    beside it, which then takes its name (a crash leaves no half-written cache)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    tmp.chmod(0o755)
    try:
        fill(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _eos_token_ids(tokenizer: PreTrainedTokenizerBase, path: Path) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_config = path / "generation_config.json" if path.is_dir() else None
    if gen_config is not None and gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return frozenset(ids)
