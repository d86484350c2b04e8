"""Loaded weights -> the model the engine runs: fp32 with oneDNN-packed linears, or int8.

int8 weights are produced once (calibration, smoothing, quantization: a few seconds) and
kept next to the converted fp32 weights, so a warm start maps them directly and never
touches the fp32 file.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.config import ModelConfig
from app.model.llama import LlamaModel
from app.model.loader import LoadedModel, read_tensors, write_cache_dir
from app.model.quant.int8 import (
    QUANT_FORMAT,
    int8_available,
    model_from_quantized,
    quantize_model,
    quantized_state_dict,
)

log = logging.getLogger(__name__)


def check_quantization(cfg: ModelConfig, device: str) -> None:
    """Refuse, with the reason, a weight format this machine cannot run."""
    if cfg.quantization != "int8":
        return
    if torch.device(device).type != "cpu" or not int8_available():
        raise ValueError("int8 weights need the CPU and a PyTorch build with fbgemm")
    if cfg.dtype != "float32":
        raise ValueError("int8 weights are made from float32 weights (dtype float32)")


def build_model(
    loaded: LoadedModel, cfg: ModelConfig, device: str, max_positions: int
) -> tuple[LlamaModel, str]:
    """The runtime model and a word on its weights for the start-up log."""
    check_quantization(cfg, device)
    if cfg.quantization == "int8":
        return _int8_model(loaded, cfg.cache_dir, max_positions), "int8 (W8A8, fbgemm)"
    dtype = getattr(torch, cfg.dtype)
    weights = {k: v.to(dtype) for k, v in loaded.weights.items()}  # no copy when equal
    model = LlamaModel.from_weights(loaded.arch, weights, max_positions).to(device)
    if torch.device(device).type == "cpu":
        model.pack_for_cpu()
    return model, cfg.dtype


def _int8_model(loaded: LoadedModel, cache_dir: Path, max_positions: int) -> LlamaModel:
    target = None
    if loaded.cache_key is not None:
        target = cache_dir / "converted" / f"{loaded.cache_key}-{QUANT_FORMAT}"
        if (target / "model.safetensors").exists():
            state = read_tensors(target / "model.safetensors")
            return model_from_quantized(loaded.arch, state, max_positions)
    started = time.monotonic()
    # The fp32 tensors may be memory-mapped from the cache: work on copies.
    weights = {k: v.clone() for k, v in loaded.weights.items()}
    model = quantize_model(
        LlamaModel.from_weights(loaded.arch, weights, max_positions), loaded.tokenizer
    )
    log.info("quantized %s to int8 in %.1f s", loaded.name, time.monotonic() - started)
    if target is not None:
        state = {k: v.contiguous() for k, v in quantized_state_dict(model).items()}
        write_cache_dir(target, lambda tmp: save_file(state, str(tmp / "model.safetensors")))
    return model
