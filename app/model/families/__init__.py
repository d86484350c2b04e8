"""One module per model family beyond Llama's own decoder (app/model/llama.py), over its
shared layers: qwen3 (q/k norms), gemma3 (sandwich norms, local attention). `model_class`
picks the decoder for an ArchConfig's architecture; `layer_norms` says which of a
checkpoint's per-layer norms become which of ours."""

from __future__ import annotations

from app.model.arch import ArchConfig

_LLAMA_NORMS = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_norm.weight",
}
_QK_NORMS = {"self_attn.q_norm.weight": "q_norm.weight", "self_attn.k_norm.weight": "k_norm.weight"}
# Gemma normalizes the attention's output and the MLP's too; our post_norm stays the norm
# that feeds the MLP (Gemma's pre-feedforward norm).
_GEMMA_NORMS = _QK_NORMS | {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "attn_out_norm.weight",
    "pre_feedforward_layernorm.weight": "post_norm.weight",
    "post_feedforward_layernorm.weight": "mlp_out_norm.weight",
}


def layer_norms(arch: ArchConfig) -> tuple[dict[str, str], float]:
    """(Hugging Face per-layer norm name -> ours, what to add to every norm weight): Gemma
    scales by 1 + w, our RMSNorm by w."""
    if arch.architecture == "gemma3":
        return _GEMMA_NORMS, 1.0
    if arch.qk_norm:
        return _LLAMA_NORMS | _QK_NORMS, 0.0
    return _LLAMA_NORMS, 0.0


def model_class(arch: ArchConfig) -> type:
    """The decoder class (a LlamaModel) that runs `arch`."""
    if arch.architecture == "gemma3":
        from app.model.families.gemma3 import Gemma3Model

        return Gemma3Model
    if arch.architecture == "qwen3":
        from app.model.families.qwen3 import Qwen3Model

        return Qwen3Model
    from app.model.llama import LlamaModel

    return LlamaModel
