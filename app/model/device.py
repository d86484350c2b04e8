"""Which device runs the model: the --device flag resolved once, at engine construction.

"auto" is CUDA when PyTorch sees a GPU, else the CPU. Everything device-specific (pinned
host buffers, FlexAttention decode, CUDA graphs, oneDNN packing, thread counts) is chosen
from the resolved device once; the per-step code never asks again.
"""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """ "auto" | "cpu" | "cuda" | "cuda:N" (or any torch device name) -> a torch.device.
    Raises ValueError for a CUDA device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"not a device: {name!r} (cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: PyTorch sees no CUDA GPU here (try --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} GPU(s) here")
    return device
