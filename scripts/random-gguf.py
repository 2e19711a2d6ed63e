#!/usr/bin/env python3
"""Writes a llama-architecture GGUF with random f16 weights, for benchmarks of formats the
default model cannot hold.

The default model's rows are 576 values long, which no K-quant super-block (256 values)
divides, so llama.cpp's quantizer falls back to Q5_0/Q8_0 for most of its tensors. This
writes a model of the same family whose every dimension is a multiple of 256, carrying the
default model's tokenizer and chat template, so `llama-quantize` gives real K-quant files:

    python3 scripts/random-gguf.py /tmp/rand-f16.gguf
    llama-quantize /tmp/rand-f16.gguf /tmp/rand-Q4_K_M.gguf Q4_K_M

Throughput does not depend on the weight values; the text such a model writes is noise.
Deterministic (fixed seed). Needs `pip install gguf numpy`.
"""

import argparse
from pathlib import Path

import numpy as np
import gguf

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer-from", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=20261201)
    a = p.parse_args()
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error("hidden must divide by heads, and heads by kv-heads")
    head_dim = a.hidden // a.heads

    src = gguf.GGUFReader(a.tokenizer_from)
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(f"random llama {a.hidden}x{a.layers}")
    w.add_context_length(8192)
    w.add_embedding_length(a.hidden)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # The tokenizer and chat template, copied field by field from the source model.
    vocab = 0
    for field in src.fields.values():
        if not (field.name.startswith("tokenizer.")):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(value)
            w.add_array(field.name, value) if sub == gguf.GGUFValueType.STRING else w.add_key_value(
                field.name, value, gguf.GGUFValueType.ARRAY, sub_type=sub
            )
        else:
            w.add_key_value(field.name, value, field.types[0])
    w.add_vocab_size(vocab)

    rng = np.random.default_rng(a.seed)

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    kv = a.kv_heads * head_dim
    w.add_tensor("token_embd.weight", matrix(vocab, a.hidden))
    w.add_tensor("output_norm.weight", np.ones(a.hidden, dtype=np.float32))
    for i in range(a.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(a.hidden, dtype=np.float32))
        w.add_tensor(b + "attn_q.weight", matrix(a.hidden, a.hidden))
        w.add_tensor(b + "attn_k.weight", matrix(kv, a.hidden))
        w.add_tensor(b + "attn_v.weight", matrix(kv, a.hidden))
        w.add_tensor(b + "attn_output.weight", matrix(a.hidden, a.hidden))
        w.add_tensor(b + "ffn_norm.weight", np.ones(a.hidden, dtype=np.float32))
        w.add_tensor(b + "ffn_gate.weight", matrix(a.ffn, a.hidden))
        w.add_tensor(b + "ffn_up.weight", matrix(a.ffn, a.hidden))
        w.add_tensor(b + "ffn_down.weight", matrix(a.hidden, a.ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
