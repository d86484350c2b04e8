"""Loaded weights -> the model the engine runs, in the weight format ModelConfig asks for
or, for "auto", the one that suits the checkpoint and this CPU:

- "none": the weights as loaded, in `dtype`, linears prepacked for oneDNN on x86;
- "int8": app.model.quant.int8 (calibrated once, cached);
- "int4": app.model.quant.int4 (a GGUF's Q4_0 / Q4_1 blocks as stored, others rounded;
  the codes cached, so a warm start neither reads the GGUF nor rounds anything).

"auto" serves a checkpoint whose linear weights are 4-bit (the default model is Q4_1) in
int4, with the activations in bf16 where the CPU has native bf16 (AVX-512 BF16 or AMX) and
in fp32 elsewhere (the int4 matmuls themselves always run in bf16). Other checkpoints are
served as loaded, in fp32. On CUDA "auto" is the weights as loaded in bf16 (the int4 and
int8 kernels here are CPU ones). The start-up log says what was chosen and why.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.config import ModelConfig
from app.model import cpu, kernels, weight_arena
from app.model.families import model_class
from app.model.llama import FusedCpuOps, LlamaModel
from app.model.loader import LoadedModel, read_tensors, write_cache_dir
from app.model.quant.int4 import (
    decode_layers_weights,
    int4_available,
    int4_from_state_dict,
    int4_linears,
    int4_state_dict,
    model_from_int4,
    normed_layers_weights,
)
from app.model.quant.int8 import (
    QUANT_FORMAT,
    int8_available,
    model_from_quantized,
    quantize_model,
    quantized_state_dict,
)
from app.model.quant.kquants import (
    GROUP_TYPES,
    GroupEmbedding,
    GroupLinear,
    GroupWeight,
    TiledGroupWeight,
    group_matmul_available,
    int8_head_fits,
)
from app.model.quant.q8_0 import BlockLinear, Q8Embedding, Q8Weight, block_matmul_available

log = logging.getLogger(__name__)

# Bump when the stored layout changes (v2: Q8_0 embedding, LM head; v3: scale and offset;
# v4: GGUF's other block formats as stored).
INT4_FORMAT = "int4-v4"
# Tensors served from their Q8_0 bytes where the GGUF stores them so (app.model.quant.q8_0).
EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
LM_HEAD_OURS = "lm_head.weight"  # the same name in our layout (app.model.loader.fuse_weights)
NATIVE_4BIT = frozenset({"Q4_0", "Q4_1"})  # GGUF types the int4 kernel runs as they are
# GGUF types served as stored, whatever their bits: NATIVE_4BIT on q4_matmul, the others
# (K-quants, Q5_0/Q5_1, Q8_0) on group_matmul with fp32 group scales.
AS_STORED = GROUP_TYPES
EXACT_REFERENCE = "--quantization none --dtype float32"


@dataclass(frozen=True)
class WeightFormat:
    """What the model runs: its linear weights' format, and the dtype of activations, K/V
    and float weights; `why` says how "auto" was resolved (for the start-up log)."""

    quantization: str  # "none" | "int8" | "int4"
    dtype: str  # "float32" | "bfloat16" | "float16"
    why: str = ""
    stored: tuple[str, ...] = ()  # int4: the GGUF types its linears run as stored

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        weights = {"none": "weights as loaded", "int8": "int8 weights (W8A8, fbgemm)"}.get(
            self.quantization, "int4 weights (groups of 32, bf16 matmuls)"
        )
        if self.quantization == "int4" and not set(self.stored) <= NATIVE_4BIT:
            # K-quants, Q5_0/Q5_1, Q8_0 beside or instead of Q4_0/Q4_1 (app.model.quant.kquants)
            weights = (
                f"GGUF weights as stored ({'/'.join(self.stored)}: Q4_0/Q4_1 as int4, "
                "the others on group_matmul with the file's group scales)"
            )
        return f"{weights}, {self.dtype} activations and K/V"


@dataclass
class BuiltModel:
    """The runtime model and what the engine needs to know about it."""

    model: LlamaModel
    format: WeightFormat
    weight_bytes: int  # resident bytes of weights, however they are stored


def choose_format(cfg: ModelConfig, loaded: LoadedModel, device: str) -> WeightFormat:
    """Resolve "auto" in cfg.quantization and cfg.dtype; refuse a format this machine cannot
    run, with the reason."""
    on_cpu = torch.device(device).type == "cpu"
    quantization, dtype, why = cfg.quantization, cfg.dtype, []
    if quantization == "auto":
        stored = loaded.linear_types()
        if on_cpu and int4_available() and stored and stored <= AS_STORED:
            quantization = "int4"
            why.append(
                f"the checkpoint's linear weights are {'/'.join(sorted(stored))}: "
                "int4, each type as stored"
            )
        elif not on_cpu:
            quantization = "none"
            why.append(f"weights as loaded: the int4/int8 kernels here are CPU ones, not {device}")
        else:
            quantization = "none"
            why.append("weights as loaded")
    if dtype == "auto":
        if not on_cpu:
            dtype = "bfloat16"
            why.append(f"bf16 on {device}")
        elif quantization == "int4" and cpu.cpu_has_bf16():
            dtype = "bfloat16"
            why.append(f"bf16 activations: this CPU has native bf16 ({cpu.describe_cpu()})")
        elif quantization == "int4":
            # The int4 matmuls still run in bf16 (the kernel's only vectorized path), but
            # without native bf16 attention, norms and the LM head are emulated in bf16:
            # with AVX2 kernels, decode at 8-32 requests ran 1.3-1.5x faster with fp32
            # around the matmuls (bench/README.md, "int4 weights").
            dtype = "float32"
            why.append(f"fp32 activations: no native bf16 on this CPU ({cpu.describe_cpu()})")
        else:
            dtype = "float32"
    if quantization == "int8":
        if not on_cpu or not int8_available():
            raise ValueError("int8 weights need the CPU and a PyTorch build with fbgemm")
        if dtype != "float32":
            raise ValueError("int8 weights are made from float32 weights (dtype float32)")
    if quantization == "int4":
        if not on_cpu or not int4_available():
            raise ValueError("int4 weights need the CPU and PyTorch's CPU int4 kernel (>= 2.6)")
        if dtype not in ("bfloat16", "float32"):
            raise ValueError("int4 runs with bfloat16 or float32 activations")
    stored = tuple(sorted(loaded.linear_types() & AS_STORED)) if quantization == "int4" else ()
    return WeightFormat(quantization, dtype, "; ".join(why), stored)


def build_model(
    loaded: LoadedModel, cfg: ModelConfig, device: str, max_positions: int
) -> BuiltModel:
    """The runtime model, in the format `choose_format` picks."""
    fmt = choose_format(cfg, loaded, device)
    log.info(
        "model %s: %s%s; exact reference: %s",
        loaded.name,
        fmt.describe(),
        f"; chosen by auto: {fmt.why}" if fmt.why else "",
        EXACT_REFERENCE,
    )
    on_cpu = torch.device(device).type == "cpu"
    no_kernels = _cpu_kernels(cfg, fmt) if on_cpu else "not on the CPU"
    if fmt.quantization == "int8":
        model = _int8_model(loaded, cfg.cache_dir, max_positions)
    elif fmt.quantization == "int4":
        kernel = "parley" if no_kernels is None else "aten"
        model, q8 = _int4_model(loaded, cfg.cache_dir, fmt.torch_dtype, max_positions, kernel)
        log.info("int4 linears on %s", _int4_kernel_name(kernel))
        log.info("linear weights by stored type: %s", _kernels_by_type(loaded, kernel))
    else:
        weights = {k: v.to(fmt.torch_dtype) for k, v in loaded.weights.items()}  # no copy if equal
        decoder = model_class(loaded.arch)
        model = decoder.from_weights(loaded.arch, weights, max_positions).to(device)
        if torch.device(device).type == "cpu":
            model.pack_for_cpu()
    if on_cpu:
        _use_cpu_kernels(model, cfg, fmt)
    if fmt.quantization == "int4":
        head = None if loaded.arch.tie_word_embeddings else loaded.weights.get(LM_HEAD_OURS)
        _int4_head(model, q8, fmt.torch_dtype, kernel=model.ops.fused, float_head=head)
        if held := group_layouts(model):
            log.info("group_matmul weights as held: %s", held)
    if on_cpu and (arena := weight_arena.gather(model)) is not None:
        log.info(
            "weights: %d tensors, %.0f MB, in one block on %s",
            arena.tensors, arena.nbytes / 1e6, arena.huge_pages,
        )  # fmt: skip
    return BuiltModel(model, fmt, weight_bytes(model))


def group_layouts(model: torch.nn.Module) -> str:
    """How the model's group_matmul weights are held (TiledGroupWeight: the bits a code
    their range needs, fp16 or fp32 scales), counted, for the start-up log."""
    held = Counter(
        f"{m.tiled.bits}-bit codes with {str(m.tiled.scale.dtype).removeprefix('torch.')} scales"
        for m in model.modules()
        if isinstance(m, GroupLinear) and m.kernel
    )
    return ", ".join(f"{n} at {kind}" for kind, n in sorted(held.items()))


def _int4_head(
    model: LlamaModel,
    q8: dict[str, Q8Weight | GroupWeight],
    dtype: torch.dtype,
    kernel: bool,
    float_head: torch.Tensor | None = None,
) -> None:
    """The int4 model's embedding and LM head: from the checkpoint's Q8_0 bytes where it
    has them (app.model.quant.q8_0), and the LM head on Parley's group_matmul or
    block_matmul wherever the kernels are loaded (a logit's bits then depend on nothing but
    the token's row); else oneDNN's packed bf16 head, as model_from_int4 left it.
    `kernel`: Parley's kernels serve this model (--cpu-kernels)."""
    embedding = q8.get(EMBEDDING)
    head = embedding if model.arch.tie_word_embeddings else q8.get(LM_HEAD)
    kernel = kernel and block_matmul_available() and group_matmul_available()
    replace_embedding = embedding is not None and (kernel or not model.arch.tie_word_embeddings)
    # What is replaced goes first: the float embedding and its packed copy are the model's
    # largest tensors (Gemma 3's: 2 x 335 MB), and tiling the head needs room of its own.
    if replace_embedding:
        model.embed_tokens = None
    tiled = None
    if kernel:
        model.packed_lm_head = None
        if isinstance(head, GroupWeight) or (head is not None and dtype == torch.bfloat16):
            # The checkpoint's quantized head on group_matmul (bf16 dot products: x is bf16
            # already), tiled once; a tied embedding looks its rows up in the same bytes.
            tiled = TiledGroupWeight.tile(_as_group(head))
            model.packed_lm_head = GroupLinear(tiled, fp32_out=True, int8_x=int8_head_fits(tiled))
        elif head is not None:
            # fp32 activations (no native bf16): block_matmul keeps them exact.
            model.packed_lm_head = BlockLinear(head)
        else:
            # An untied float head: the checkpoint's (model_from_int4 packed it for oneDNN
            # and dropped the module, so lm_head_weight would name the embedding).
            fallback = model.lm_head_weight if float_head is None else float_head.to(dtype)
            model.packed_lm_head = BlockLinear(fallback)
        model.lm_head = None
    if replace_embedding:
        if head is embedding and tiled is not None:
            model.embed_tokens = GroupEmbedding(tiled, dtype)
            model.embed_tokens.weight_nbytes = 0  # one copy of the bytes serves both
        elif isinstance(embedding, GroupWeight):
            model.embed_tokens = GroupEmbedding(embedding, dtype)
        else:
            model.embed_tokens = Q8Embedding(embedding, dtype)
            if head is embedding and isinstance(model.packed_lm_head, BlockLinear):
                model.embed_tokens.weight_nbytes = 0  # the head's bytes, counted there

    def kind(w: object) -> str:
        if isinstance(w, Q8Weight):
            return "Q8_0 as stored"
        return "as stored" if isinstance(w, GroupWeight) else f"{dtype}"

    on = "Parley's group_matmul" if tiled is not None else "Parley's block_matmul"
    if isinstance(model.packed_lm_head, GroupLinear) and model.packed_lm_head.int8_x:
        on = f"Parley's q8_matmul (x as 8-bit codes; {torch.ops.parley.q8_path()})"
    log.info(
        "embedding: %s; LM head: %s",
        kind(embedding) if embedding is not None and kernel else f"{dtype}",
        kind(head) + (f" on {on}" if kernel else " on oneDNN"),
    )


def _as_group(w: Q8Weight | GroupWeight) -> GroupWeight:
    return w if isinstance(w, GroupWeight) else GroupWeight(w.codes, w.scale, None, 32)


def prompt_attention_in_place() -> bool:
    """Whether prompts attend through Parley's kernel (paged_prefill) rather than
    PyTorch's flash kernel: where the CPU has AVX-512. Either gives correct results; the
    kernel gives a row a decode's bits and is faster there, while its portable build (AVX2)
    took ~2x the flash kernel's time on the CPU we measured on (bench/README.md, "Parley's
    CPU kernels")."""
    return cpu.cpu_has_avx512()


def _cpu_kernels(cfg: ModelConfig, fmt: WeightFormat) -> str | None:
    """Load Parley's CPU kernels where this model uses them (app/model/kernels); None when
    they are loaded, else why not."""
    if cfg.cpu_kernels == "off":
        return "off (--cpu-kernels off)"
    if cfg.cpu_kernels == "auto" and fmt.quantization != "int4":
        return f"off: auto uses them for int4 weights, not {fmt.quantization} (--cpu-kernels on)"
    if fmt.dtype not in ("float32", "bfloat16"):
        return f"not for {fmt.dtype}"
    return kernels.load(cfg.cache_dir)


def _int4_kernel_name(kernel: str) -> str:
    if kernel == "parley":
        return f"Parley's q4_matmul ({torch.ops.parley.q4_path()})"
    return "PyTorch's int4 kernel (Parley's kernels are not loaded)"


def _use_cpu_kernels(model: LlamaModel, cfg: ModelConfig, fmt: WeightFormat) -> None:
    """Parley's fused kernels for the layers' small ops, where they build (see
    app/model/kernels); PyTorch's ops otherwise, with the reason in the log."""
    why = _cpu_kernels(cfg, fmt)  # loaded once a process: a second ask is a lookup
    if why is None:
        in_place = prompt_attention_in_place()
        model.use_ops(FusedCpuOps(in_place, decode_layers_weights, normed_layers_weights))
        arch = model.arch
        path = torch.ops.parley.attention_path(
            fmt.torch_dtype, arch.head_dim, arch.num_heads // arch.num_kv_heads
        )
        log.info(
            "layer ops: Parley's CPU kernels (norms, rotary + K/V write, decode attention%s;"
            " attention: %s)",
            ", prompt attention" if in_place else "; prompt attention: PyTorch's, without AVX-512",
            path,
        )
    else:
        log.info("layer ops: PyTorch's; Parley's CPU kernels %s", why)


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters plus the weights that packed layers hold outside them."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(getattr(m, "weight_nbytes", 0) for m in model.modules())


def _head_from_state(state: dict[str, torch.Tensor], name: str) -> Q8Weight | GroupWeight | None:
    if f"{name}.gcodes" in state:
        return GroupWeight.from_state(state, name)
    return Q8Weight.from_state(state, name)


def _kernels_by_type(loaded: LoadedModel, kernel: str) -> str:
    """Which kernel each stored type of the linears runs on, for the start-up log."""
    q4 = "Parley's q4_matmul" if kernel == "parley" else "PyTorch's int4 kernel"
    group = "Parley's group_matmul" if kernel == "parley" else "fp32 dequantized"
    if kernel == "parley":
        group += f" ({torch.ops.parley.group_path()})"
    out = []
    for t in sorted(loaded.linear_types()):
        if t in NATIVE_4BIT:
            out.append(f"{t} on {q4} (where a fused linear mixes types: {group})")
        elif t in AS_STORED:
            out.append(f"{t} on {group}")
        else:
            out.append(f"{t} rounded to 4 bits on {q4}")
    return "; ".join(out) or "floats rounded to 4 bits"


def _int4_model(
    loaded: LoadedModel, cache_dir: Path, dtype: torch.dtype, max_positions: int, kernel: str
) -> tuple[LlamaModel, dict[str, Q8Weight | GroupWeight]]:
    """The int4 model, and the embedding / LM head as the checkpoint's Q8_0 bytes where it
    stores them so (by Hugging Face name)."""
    target = None
    if loaded.cache_key is not None:
        target = cache_dir / "converted" / f"{loaded.cache_key}-{INT4_FORMAT}"
        if (target / "model.safetensors").exists():
            state = read_tensors(target / "model.safetensors")
            q8 = {n: w for n in (EMBEDDING, LM_HEAD) if (w := _head_from_state(state, n))}
            linears = int4_from_state_dict(state)
            model = model_from_int4(
                loaded.arch, loaded.weights, linears, dtype, max_positions, kernel=kernel
            )
            return model, q8
    started = time.monotonic()
    stored, q8 = {}, {}
    if loaded.source is not None and loaded.source.suffix == ".gguf":
        from app.model.gguf_file import iter_group_weights, iter_q4_weights, open_gguf

        reader, _ = open_gguf(loaded.source)
        stored = dict(iter_q4_weights(reader, loaded.arch))
        heads = frozenset((EMBEDDING, LM_HEAD))
        for name, w in iter_group_weights(reader, loaded.arch):
            if name in heads:
                # Per 32 without offsets (Q8_0, Q5_0) is Q8Weight's form.
                q8[name] = Q8Weight(w.codes, w.scale) if w.group == 32 and w.offset is None else w
            elif name.endswith("_proj.weight"):
                stored[name] = w
    linears, as_stored = int4_linears(loaded.arch, loaded.weights, stored)
    parts = 7 * loaded.arch.num_layers  # q, k, v, o, gate, up, down
    log.info(
        "int4 weights of %s in %.1f s: %d of %d linear weights as the checkpoint stores them, "
        "the others rounded to nearest",
        loaded.name,
        time.monotonic() - started,
        as_stored,
        parts,
    )
    if target is not None:
        state = int4_state_dict(linears)
        for name, w in q8.items():
            state.update(w.state(name))
        info = {"as_stored": str(as_stored), "parts": str(parts)}
        write_cache_dir(
            target, lambda tmp: save_file(state, str(tmp / "model.safetensors"), metadata=info)
        )
    model = model_from_int4(
        loaded.arch, loaded.weights, linears, dtype, max_positions, kernel=kernel
    )
    return model, q8


def _int8_model(loaded: LoadedModel, cache_dir: Path, max_positions: int) -> LlamaModel:
    target = None
    if loaded.cache_key is not None:
        target = cache_dir / "converted" / f"{loaded.cache_key}-{QUANT_FORMAT}"
        if (target / "model.safetensors").exists():
            state = read_tensors(target / "model.safetensors")
            return model_from_quantized(loaded.arch, state, max_positions)
    started = time.monotonic()
    # The fp32 tensors may be memory-mapped from the cache: work on copies.
    weights = {k: v.float().clone() for k, v in loaded.weights.items()}
    model = quantize_model(
        LlamaModel.from_weights(loaded.arch, weights, max_positions), loaded.tokenizer
    )
    log.info("quantized %s to int8 in %.1f s", loaded.name, time.monotonic() - started)
    if target is not None:
        state = {k: v.contiguous() for k, v in quantized_state_dict(model).items()}
        write_cache_dir(target, lambda tmp: save_file(state, str(tmp / "model.safetensors")))
    return model
