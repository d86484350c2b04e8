"""The shape of a Llama-family decoder, read from a Hugging Face config.json or from GGUF
metadata. Llama, Mistral, Qwen2 and SmolLM share it; their differences are fields here."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from app.model.registry import SUPPORTED_ARCHITECTURES


@dataclass(frozen=True)
class ArchConfig:
    """Hyper-parameters of the decoder. `rope_scaling` follows transformers' dict form
    ({"rope_type": "llama3" | "linear" | "default", "factor": ..., ...}), plus one of
    llama.cpp's: {"rope_type": "freq_factors", "factors": [...]}, a divisor for each of the
    head_dim / 2 rotary frequencies (what a GGUF's `rope_freqs` tensor holds)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    # Families beyond Llama's (app/model/families): RMSNorm of each head's q and k before
    # the rotary (qwen3, gemma3); local attention over the last `local_window` positions
    # in every layer but each `global_every`-th, with its own rotary base (gemma3).
    qk_norm: bool = False
    local_window: int | None = None
    global_every: int = 0
    rope_local_theta: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "linear", "llama3", "freq_factors"):
            raise ValueError(f"unsupported rope scaling {rope_type!r}")
        if rope_type == "freq_factors":
            factors = self.rope_scaling["factors"]  # type: ignore[index]
            if len(factors) != self.head_dim // 2 or min(factors) <= 0:
                raise ValueError(
                    f"rope frequency factors: {self.head_dim // 2} positive numbers expected, "
                    f"got {len(factors)}"
                )

    def layer_window(self, layer: int) -> int | None:
        """How many positions back layer `layer` attends (None: all of them)."""
        every = self.global_every
        if self.local_window is None or (every and (layer + 1) % every == 0):
            return None
        return self.local_window

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, in float32."""
        return 2 * self.num_layers * self.kv_size * 4

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchConfig:
        return cls(**d)

    @classmethod
    def from_hf_config(cls, c: dict[str, Any]) -> ArchConfig:
        """From the fields of a transformers config.json."""
        model_type = c.get("model_type", "")
        model_type = {"gemma3_text": "gemma3"}.get(model_type, model_type)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = c["num_attention_heads"]
        rope_scaling = c.get("rope_scaling")
        rope_theta = c.get("rope_theta")
        if rope_theta is None and isinstance(c.get("rope_parameters"), dict):
            # transformers 5 folds theta and scaling into one dict.
            params = dict(c["rope_parameters"])
            rope_theta = params.pop("rope_theta", None)
            rope_scaling = params if params.get("rope_type", "default") != "default" else None
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.pop("type", "default"))
        window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
        if c.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("a partial rotary (partial_rotary_factor < 1) is not supported")
        gemma = model_type == "gemma3"
        return cls(
            architecture=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            attention_bias=c.get("attention_bias", model_type == "qwen2"),
            rope_scaling=rope_scaling,
            sliding_window=None if gemma else window,
            qk_norm=model_type in ("qwen3", "gemma3"),
            local_window=window if gemma else None,
            global_every=c.get("sliding_window_pattern", 6) if gemma else 0,
            rope_local_theta=c.get("rope_local_base_freq", 10000.0) if gemma else None,
        )
