"""int8 weights on the CPU: every linear layer, the LM head included.

Decode reads every weight once per step, so int8 weights (a quarter of fp32) are the
biggest lever a CPU has. The matmuls run in PyTorch's fbgemm kernels
(`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`): int8 weights with one scale
per output channel, and activations quantized on the fly.

Two measures keep the quality (perplexity within 2-3% of fp32 for SmolLM2-135M, where a
plain conversion lost 77%; that is with 8-bit activations, on a CPU with VNNI. Without it,
fbgemm's AVX2 kernel sums u8 x s8 pairs in int16, which 8-bit activations saturate: they
get 7 bits there, +6.2% measured on an AVX2 EPYC):

- Per-token activation scales. fbgemm quantizes a whole activation matrix with one scale;
  dividing each row by its largest magnitude first (and multiplying the output back) gives
  every token its own scale. The kernel is told the range [-1, 1] rather than measuring
  it, so a token's result does not depend on what else is in the batch.
- SmoothQuant (Xiao et al., 2023). A few input channels of some linears carry activations
  100x larger than the rest and would swamp every token's scale. Calibrated on a short
  text, each such channel j is divided by s_j = sqrt(max|x_j| / max|w_j|) before the
  matmul and its weight column multiplied by s_j: the product is unchanged and both sides
  quantize well. The division is folded into the operation that produces x: the RMSNorm
  weight before qkv and gate_up, the `up` half of gate_up before down.

Quality, measured (bench/README.md): perplexity +2.5% on the test text, but the greedy
continuation of a chat prompt often parts from fp32's within 16 tokens, because this small
model's top two candidates are often < 0.1 logit apart while int8 moves logits by ~1. So
int8 is an option, not the default.

Kernel: PyTorch 2.13 deprecates the quantized tensor type that `linear_prepack` takes (the
fbgemm kernels themselves stay); the warning is silenced here, and the day it goes, the
same int8 layout moves to torchao's kernels.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from app.model import cpu
from app.model.llama import LlamaModel

log = logging.getLogger(__name__)

QUANT_FORMAT = "int8-v1"  # bump when the stored layout or the calibration changes
SMOOTH_ALPHA = 0.5
SMOOTHED = ("qkv", "gate_up", "down")  # o_proj's input is grouped by head: left as is
CALIBRATION_TEXT = Path(__file__).parent.parent / "calibration.txt"  # package data of app.model


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


# quantize x with the given (scale, zero point), int8 GEMM, dequantize to fp32: one call.
_int8_linear = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 (per output channel) and x quantized per token."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        zero = torch.zeros(qweight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # see "Kernel" in the module docstring
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions")
            q = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zero, 0)
        self.packed = torch.ops.quantized.linear_prepack(q, None)
        self.bias = bias
        self.weight_nbytes = qweight.numel() + 4 * scale.numel()
        # uint8 codes for [-1, 1]: 0..255, or 0..127 where fbgemm needs 7 bits (no VNNI).
        levels = 255 if cpu.cpu_has_vnni() else 127
        self.x_scale, self.x_zero_point = 2 / levels, (levels + 1) // 2

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        qweight, scale = quantize_weight(weight)
        return cls(qweight, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        peak = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True)  # (rows, 1)
        peak.clamp_min_(1e-12)
        y = _int8_linear(x / peak, self.x_scale, self.x_zero_point, self.packed).mul_(peak)
        return y if self.bias is None else y.add_(self.bias)

    def quantized_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        q, _ = torch.ops.quantized.linear_unpack(self.packed)
        return q.int_repr(), q.q_per_channel_scales().float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (int8 [N, K], float32 scales [N])."""
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.float()


# -- calibration and smoothing ---------------------------------------------------------


@torch.inference_mode()
def calibrate(model: LlamaModel, token_ids: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """Largest |activation| per input channel of each smoothed linear, over one pass of the
    calibration tokens."""
    stats: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        for name in SMOOTHED:

            def record(module, args, key=(i, name)):
                peak = args[0].detach().abs().amax(dim=0)
                stats[key] = torch.maximum(stats[key], peak) if key in stats else peak

            hooks.append(getattr(layer, name).register_forward_pre_hook(record))
    try:
        model.forward_tokens(token_ids, torch.tensor([len(token_ids) - 1]))
    finally:
        for h in hooks:
            h.remove()
    return stats


@torch.inference_mode()
def smooth(model: LlamaModel, stats: dict, alpha: float = SMOOTH_ALPHA) -> None:
    """Move activation outliers into the weights (see the module docstring), in place."""
    inter = model.arch.intermediate_size
    for i, layer in enumerate(model.layers):
        for name in SMOOTHED:
            linear = getattr(layer, name)
            x_peak = stats[(i, name)].clamp_min(1e-5)
            w_peak = linear.weight.abs().amax(dim=0).clamp_min(1e-5)
            s = (x_peak.pow(alpha) / w_peak.pow(1 - alpha)).clamp_min(1e-5)
            linear.weight.mul_(s[None, :])
            if name == "qkv":
                layer.input_norm.weight.div_(s)
            elif name == "gate_up":
                layer.post_norm.weight.div_(s)
            else:  # down's input is silu(gate) * up: scale the up rows
                layer.gate_up.weight[inter:].div_(s[:, None])


def calibration_ids(tokenizer) -> list[int]:
    return tokenizer.encode(CALIBRATION_TEXT.read_text(), add_special_tokens=False)[:1024]


# -- the quantized model -----------------------------------------------------------------


@torch.inference_mode()
def quantize_model(model: LlamaModel, tokenizer) -> LlamaModel:
    """fp32 model -> int8 linears (calibrated and smoothed), in place."""
    ids = calibration_ids(tokenizer)[: model.rotary.cos.shape[0]]  # within the positions
    smooth(model, calibrate(model, ids))
    for layer in model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            linear = getattr(layer, name)
            setattr(layer, name, Int8Linear.from_float(linear.weight, linear.bias))
    model.packed_lm_head = Int8Linear.from_float(model.lm_head_weight.detach(), None)
    model.lm_head = None
    return model


def quantized_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """What the disk cache keeps: int8 weights and scales, plus the plain tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, Int8Linear):
            q, s = module.quantized_state()
            out[f"{name}.qweight"], out[f"{name}.scale"] = q.contiguous(), s
            if module.bias is not None:
                out[f"{name}.bias"] = module.bias
    for name, p in model.named_parameters():
        out[name] = p.detach()
    return out


def model_from_quantized(arch, state: dict[str, torch.Tensor], max_positions: int) -> LlamaModel:
    """Rebuild the int8 model from quantized_state_dict() without any fp32 linear.
    Consumes `state`: each int8 weight leaves it (and memory) once packed."""
    model = LlamaModel(arch, max_positions, device="meta")
    plain = {k: v for k, v in state.items() if not k.endswith((".qweight", ".scale"))}
    for i, layer in enumerate(model.layers):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            p = f"layers.{i}.{name}"
            bias = plain.pop(f"{p}.bias", None)
            q, scale = state.pop(f"{p}.qweight"), state.pop(f"{p}.scale")
            setattr(layer, name, Int8Linear(q, scale, bias))
    q, scale = state.pop("packed_lm_head.qweight"), state.pop("packed_lm_head.scale")
    model.packed_lm_head = Int8Linear(q, scale, None)
    model.lm_head = None
    model.load_state_dict(plain, strict=True, assign=True)
    return model.eval().requires_grad_(False)
