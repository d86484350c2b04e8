"""A GGUF file of a bigger model's shape, with random weights, for the benchmarks: the
default model's tokenizer and chat template, Q4_1 linears and a Q8_0 embedding, as
llama.cpp quantizes a real model. Both Parley and llama-server load it, so their speed can
be compared at sizes the default model does not reach.

    python bench/make_gguf.py                       # 1B shape: 16 x 2048, 32/8 heads, FFN 8192
    python bench/make_gguf.py --layers 24 --hidden 2048 --out big.gguf

Random weights give random text, but the same bytes to read and the same work a step as a
trained model of that shape: speed, not quality, is what this file measures. Weights are
scaled so that activations stay in a float's range through every layer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def copy_tokenizer(writer: GGUFWriter, source: Path) -> int:
    """Every tokenizer.* field of `source` (vocabulary, merges, chat template); the
    vocabulary's size."""
    reader = GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def write(path: Path, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
          context: int, seed: int) -> Path:  # fmt: skip
    from app.config import ModelConfig
    from app.model.registry import default_model_path

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"random-{layers}x{hidden}")
    vocab = copy_tokenizer(writer, default_model_path(ModelConfig().cache_dir))
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)

    def weight(rows: int, cols: int, kind: GGML, name: str) -> None:
        w = rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)
        writer.add_tensor(name, quantize(w, kind), raw_dtype=kind)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))

    weight(vocab, hidden, GGML.Q8_0, "token_embd.weight")
    norm("output_norm.weight")
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        weight(heads * head_dim, hidden, GGML.Q4_1, f"blk.{i}.attn_q.weight")
        weight(kv_heads * head_dim, hidden, GGML.Q4_1, f"blk.{i}.attn_k.weight")
        weight(kv_heads * head_dim, hidden, GGML.Q4_1, f"blk.{i}.attn_v.weight")
        weight(hidden, heads * head_dim, GGML.Q4_1, f"blk.{i}.attn_output.weight")
        weight(ffn, hidden, GGML.Q4_1, f"blk.{i}.ffn_gate.weight")
        weight(ffn, hidden, GGML.Q4_1, f"blk.{i}.ffn_up.weight")
        weight(hidden, ffn, GGML.Q4_1, f"blk.{i}.ffn_down.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "random-1b.Q4_1.gguf")
    args = ap.parse_args()
    started = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = write(args.out, args.layers, args.hidden, args.heads, args.kv_heads, args.ffn,
                 args.context, args.seed)  # fmt: skip
    size = path.stat().st_size / 2**30
    print(f"{path} ({size:.2f} GiB) in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
