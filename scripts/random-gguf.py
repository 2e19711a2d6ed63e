#!/usr/bin/env python3
"""Writes a llama-architecture GGUF with random weights, for benchmarks of shapes and formats
no model at hand has (throughput does not depend on the weight values; the text such a
model writes is noise).

Without options it writes what it always did: a 768-wide, 24-layer f16 model carrying the
default model's tokenizer and chat template, whose every dimension is a multiple of 256, so
`llama-quantize` gives real K-quant files:

    python3 scripts/random-gguf.py /tmp/rand-f16.gguf
    llama-quantize /tmp/rand-f16.gguf /tmp/rand-Q4_K_M.gguf Q4_K_M

It can also write quantized blocks directly (random quants, scales chosen so that the
dequantized matrices have a standard deviation near 0.02; norms 1.0 in f32), with a
self-contained tokenizer, so that it runs alone where no real model can be carried:

    python3 scripts/random-gguf.py /tmp/l8b-q4km.gguf --preset llama-3.1-8b --type q4_k_m
    python3 scripts/random-gguf.py /tmp/l8b-q8.gguf --preset llama-3.1-8b --type q8_0
    python3 scripts/random-gguf.py /tmp/tiny.gguf --preset tiny --type q6_k --verify

--type q4_k_m follows llama.cpp's Q4_K_M mix: Q4_K everywhere, Q6_K for the output (or the
tied embedding) and for attn_v / ffn_down on the layers llama.cpp's `use_more_bits` picks;
q4_0 also gets a Q6_K output, as llama-quantize gives it. --tokenizer minimal writes a
Llama-3-style byte-level BPE: the 256 byte tokens, two-character merges, fillers, 256
control tokens at the end (<|begin_of_text|>, <|eot_id|>, ...) and a Llama 3 chat template.
It is the default unless a tokenizer source is given, or the default model is present and
neither --vocab nor the preset sets a vocabulary size. Presets: default, llama-3.1-8b (with
Llama 3.1's rope_freqs.weight), tiny, and the mixture-of-experts qwen3-30b-a3b and
tiny-qwen3moe (--arch qwen3moe: Qwen3's per-head q/k norms, an F32 router `ffn_gate_inp` and
the experts stacked in 3-D `ffn_{gate,up,down}_exps` tensors, as llama.cpp writes them;
--arch llama with --experts is Mixtral's layout); explicit flags override them:

    python3 scripts/random-gguf.py /tmp/tiny-moe.gguf --preset tiny-qwen3moe --type q8_0
    python3 scripts/random-gguf.py /tmp/tiny-mixtral.gguf --preset tiny --experts 4 --experts-used 2

and DeepSeek's `deepseek2` (deepseek-v2-lite, tiny-deepseek2): latent attention as llama.cpp
writes it since its MLA change (attn_kv_a_mqa, attn_kv_a_norm, attn_k_b / attn_v_b per head,
attn_q or attn_q_a/attn_q_a_norm/attn_q_b, head_count_kv 1, key_length_mla), leading dense
layers, shared experts (ffn_*_shexp) and V2-Lite's YaRN keys:

    python3 scripts/random-gguf.py /tmp/v2-lite-q8.gguf --preset deepseek-v2-lite --type q8_0

Tensors are generated
and written one at a time (peak memory about 1.5 GB for 8B).
Deterministic (fixed seed). Needs `pip install gguf numpy`.
"""

import argparse
import math
import time
from pathlib import Path

import numpy as np
import gguf

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"
T = gguf.GGMLQuantizationType
STD = 0.02  # the standard deviation every weight matrix aims at

DENSE = dict(arch="llama", experts=0, experts_used=0, expert_ffn=0, head_dim=None)
# DeepSeek's latent attention and shared experts (--arch deepseek2 only).
NO_MLA = dict(q_lora=0, kv_lora=0, qk_nope=0, qk_rope=0, v_dim=0, shared_experts=0, dense_lead=0,
              yarn_factor=0.0)
DENSE.update(NO_MLA)
PRESETS = {
    # vocab None: the copied tokenizer's size (49152 for a minimal tokenizer).
    "default": dict(hidden=768, ffn=2048, layers=24, heads=12, kv_heads=4, vocab=None,
                    rope_theta=100000.0, context=8192, tied=True, rope_freqs=False, **DENSE),
    "llama-3.1-8b": dict(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
                         rope_theta=500000.0, context=131072, tied=False, rope_freqs=True, **DENSE),
    "tiny": dict(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, vocab=2048,
                 rope_theta=10000.0, context=4096, tied=False, rope_freqs=False, **DENSE),
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, ffn=6144, layers=48, heads=32,
                          kv_heads=4, head_dim=128, vocab=151936, rope_theta=1000000.0,
                          context=40960, tied=False, rope_freqs=False, experts=128,
                          experts_used=8, expert_ffn=768, **NO_MLA),
    "tiny-qwen3moe": dict(arch="qwen3moe", hidden=256, ffn=512, layers=2, heads=4, kv_heads=2,
                          head_dim=64, vocab=2048, rope_theta=1000000.0, context=4096,
                          tied=False, rope_freqs=False, experts=8, experts_used=2,
                          expert_ffn=256, **NO_MLA),
    # DeepSeek-V2-Lite: 15.7B parameters, 2.4B active; YaRN factor 40 over 4096 positions.
    "deepseek-v2-lite": dict(arch="deepseek2", hidden=2048, ffn=10944, layers=27, heads=16,
                             kv_heads=1, head_dim=None, vocab=102400, rope_theta=10000.0,
                             context=163840, tied=False, rope_freqs=False, experts=64,
                             experts_used=6, expert_ffn=1408, q_lora=0, kv_lora=512,
                             qk_nope=128, qk_rope=64, v_dim=128, shared_experts=2,
                             dense_lead=1, yarn_factor=40.0),
    "tiny-deepseek2": dict(arch="deepseek2", hidden=256, ffn=512, layers=3, heads=4, kv_heads=1,
                           head_dim=None, vocab=2048, rope_theta=10000.0, context=4096,
                           tied=False, rope_freqs=False, experts=8, experts_used=2,
                           expert_ffn=256, q_lora=128, kv_lora=256, qk_nope=64, qk_rope=32,
                           v_dim=64, shared_experts=1, dense_lead=1, yarn_factor=0.0),
}
FILE_TYPES = {
    "f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
}


def use_more_bits(i, n):
    """llama.cpp's rule for the layers Q4_K_M gives Q6_K attn_v / ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(ftype, name, layer, n_layers, tied):
    """The storage type llama-quantize would give a 2-D tensor under `ftype`."""
    simple = {"f16": T.F16, "q8_0": T.Q8_0, "q6_k": T.Q6_K}
    if ftype in simple:
        return simple[ftype]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return T.Q6_K
    if ftype == "q4_0":
        return T.Q4_0
    if name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and use_more_bits(layer, n_layers):
        return T.Q6_K
    return T.Q4_K


def rms_int(lo, hi):
    """Root mean square of an integer drawn uniformly from lo..=hi."""
    n = hi - lo + 1
    return math.sqrt(((lo + hi) / 2) ** 2 + (n * n - 1) / 12)


class Blocks:
    """Random GGML blocks: random quant bytes; scales set so values have std ~= STD."""

    def __init__(self, rng):
        self.rng = rng

    def f16(self, n, base, signed=False):
        """n f16 scales near `base` (+-25%), as (n, 2) bytes; random signs if `signed`."""
        d = base * self.rng.uniform(0.75, 1.25, n)
        if signed:
            d *= self.rng.choice(np.array([-1.0, 1.0]), n)
        return d.astype(np.float16).view(np.uint8).reshape(n, 2)

    def make(self, qtype, n):
        """n blocks of `qtype` as an (n, type_size) uint8 array."""
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        b = self.rng.integers(0, 256, (n, size), dtype=np.uint8)
        if qtype == T.Q8_0:  # d, 32 x int8 (uniform -128..127)
            b[:, 0:2] = self.f16(n, STD / rms_int(-128, 127), signed=True)
        elif qtype == T.Q4_0:  # d, 32 x 4-bit q, value d * (q - 8)
            b[:, 0:2] = self.f16(n, STD / math.sqrt((16 * 16 - 1) / 12), signed=True)
        elif qtype == T.Q4_K:  # d, dmin, 8 x (6-bit scale, 6-bit min), 256 x 4-bit q
            # value = d*sc*q - dmin*m; with dmin = 7.5 d and m = sc it is d*sc*(q - 7.5).
            sc = self.rng.integers(32, 64, (n, 8), dtype=np.uint8)
            d = self.f16(n, STD / (math.sqrt((16 * 16 - 1) / 12) * rms_int(32, 63)))
            b[:, 0:2] = d
            b[:, 2:4] = (d.view(np.float16).astype(np.float32) * 7.5).astype(np.float16).view(np.uint8)
            b[:, 4:16] = pack_q4k_scales(sc, sc)
        elif qtype == T.Q6_K:  # 128 ql, 64 qh, 16 x int8 scale, d; value d*s*(q - 32)
            s = self.rng.integers(16, 64, (n, 16)) * self.rng.choice(np.array([-1, 1]), (n, 16))
            b[:, 192:208] = s.astype(np.int8).view(np.uint8)
            b[:, 208:210] = self.f16(n, STD / (math.sqrt((64 * 64 - 1) / 12) * rms_int(16, 63)))
        else:
            raise ValueError(f"no random blocks for {qtype.name}")
        return b


def pack_q4k_scales(sc, m):
    """Packs 8 six-bit scales and mins per block into llama.cpp's 12-byte Q4_K layout."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def llama31_rope_freqs(head_dim, theta, factor=8.0, low=1.0, high=4.0, old_ctx=8192):
    """Llama 3.1's RoPE scaling factors, as convert_hf_to_gguf.py writes rope_freqs.weight."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))
    return out.astype(np.float32)


def gpt2_byte_chars():
    """GPT-2's bytes_to_unicode: the printable character each byte is spelled with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_minimal_tokenizer(w, vocab):
    """A self-contained Llama-3-style byte-level BPE vocabulary of `vocab` tokens."""
    if vocab < 1024:
        raise SystemExit("--vocab must be at least 1024 for the minimal tokenizer")
    start = vocab - 256  # 256 control tokens at the end, as in Llama 3 (128000..128255)
    tokens = gpt2_byte_chars()
    # Two-character merges ("Ġ t" -> "Ġt", "t h" -> "th"), as many as fit, then fillers.
    merges = [(a, b) for a in "Ġabcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]
    merges = merges[: start - 256]
    tokens += [a + b for a, b in merges]
    tokens += [f"<|x{i}|>" for i in range(len(tokens), start)]
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>",
             7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>"}
    tokens += [named.get(i, f"<|reserved_special_token_{i}|>") for i in range(256)]
    assert len(tokens) == vocab and len(set(tokens)) == vocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * start + [gguf.TokenType.CONTROL] * 256)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(start)
    w.add_eos_token_id(start + 9)  # <|eot_id|>, as Llama 3.1 Instruct
    w.add_eot_token_id(start + 9)
    w.add_add_bos_token(True)
    w.add_chat_template(
        "{{- bos_token }}{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        " + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def copy_tokenizer(w, path):
    """Copies every tokenizer.* field of the GGUF at `path`; returns its vocabulary size."""
    vocab = 0
    for field in gguf.GGUFReader(path).fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(value)
            if sub == gguf.GGUFValueType.STRING:
                w.add_array(field.name, value)
            else:
                w.add_key_value(field.name, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
        else:
            w.add_key_value(field.name, value, field.types[0])
    return vocab


def verify(path):
    """Rereads `path`: byte sizes against element counts, and the spread of some weights."""
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        assert t.n_bytes == t.n_elements // block * size, t.name
    picks = {t.tensor_type: t for t in reader.tensors if len(t.shape) >= 2}
    for t in picks.values():
        data = np.asarray(t.data)
        rows = data.reshape(-1, data.shape[-1])[:64]
        values = gguf.quants.dequantize(rows, t.tensor_type)
        assert np.isfinite(values).all(), t.name
        print(f"  {t.name} {t.tensor_type.name}: mean {values.mean():+.5f} std {values.std():.5f}")
    print(f"verified {len(reader.tensors)} tensors")


def mla_layer_plan(a, i):
    """A deepseek2 layer's tensors (name, numpy shape): latent attention, then a dense MLP
    (the leading layers) or the router, the stacked experts and the shared experts."""
    h, heads, q_rows = a.hidden, a.heads, a.heads * (a.qk_nope + a.qk_rope)
    shapes = [("attn_norm.weight", (h,))]
    if a.q_lora:
        shapes += [("attn_q_a.weight", (a.q_lora, h)), ("attn_q_a_norm.weight", (a.q_lora,)),
                   ("attn_q_b.weight", (q_rows, a.q_lora))]
    else:
        shapes += [("attn_q.weight", (q_rows, h))]
    shapes += [("attn_kv_a_mqa.weight", (a.kv_lora + a.qk_rope, h)),
               ("attn_kv_a_norm.weight", (a.kv_lora,)),
               ("attn_k_b.weight", (heads, a.kv_lora, a.qk_nope)),
               ("attn_v_b.weight", (heads, a.v_dim, a.kv_lora)),
               ("attn_output.weight", (h, heads * a.v_dim)), ("ffn_norm.weight", (h,))]
    if i < a.dense_lead:
        shapes += [("ffn_gate.weight", (a.ffn, h)), ("ffn_up.weight", (a.ffn, h)),
                   ("ffn_down.weight", (h, a.ffn))]
    else:
        e, f, s = a.experts, a.expert_ffn, a.shared_experts * a.expert_ffn
        shapes += [("ffn_gate_inp.weight", (e, h)), ("ffn_gate_exps.weight", (e, f, h)),
                   ("ffn_up_exps.weight", (e, f, h)), ("ffn_down_exps.weight", (e, h, f)),
                   ("ffn_gate_shexp.weight", (s, h)), ("ffn_up_shexp.weight", (s, h)),
                   ("ffn_down_shexp.weight", (h, s))]
    return [(f"blk.{i}.{n}", shape) for n, shape in shapes]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--preset", choices=PRESETS, default="default")
    p.add_argument("--arch", choices=["llama", "qwen3moe", "deepseek2"])
    p.add_argument("--type", choices=FILE_TYPES, default="f16")
    p.add_argument("--tokenizer", choices=["auto", "minimal", "copy"], default="auto",
                   help="copy: from --tokenizer-from; auto: copy when --tokenizer-from is "
                   "given, or the default model exists and neither --vocab nor the preset sets a size")
    p.add_argument("--tokenizer-from", type=Path)
    for flag in ["hidden", "ffn", "layers", "heads", "kv-heads", "vocab", "context", "head-dim",
                 "experts", "experts-used", "expert-ffn"]:
        p.add_argument(f"--{flag}", type=int)
    p.add_argument("--rope-theta", type=float)
    p.add_argument("--tied", action=argparse.BooleanOptionalAction,
                   help="share token_embd as the output (no output.weight)")
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--verify", action="store_true", help="reread and check the file after")
    a = p.parse_args()
    asked_vocab = a.vocab  # a preset's vocabulary size yields to a copied tokenizer's
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    if (a.head_dim is None and a.hidden % a.heads) or a.heads % a.kv_heads:
        p.error("hidden must divide by heads (or give --head-dim), and heads by kv-heads")
    mla = a.arch == "deepseek2"
    if mla and not (a.kv_lora and a.qk_nope and a.qk_rope and a.v_dim):
        p.error("--arch deepseek2 takes its latent shapes from a deepseek preset")
    moe = a.arch in ("qwen3moe", "deepseek2") or a.experts > 0  # llama with experts: Mixtral's layout
    if moe and not 0 < a.experts_used <= a.experts:
        p.error("experts need --experts and 1 <= --experts-used <= --experts")
    if moe and not a.expert_ffn:
        a.expert_ffn = a.ffn
    head_dim = a.head_dim or a.hidden // a.heads
    block = 32 if a.type in ("q8_0", "q4_0") else 256 if a.type != "f16" else 1
    widths = [a.hidden, head_dim * a.heads] + ([a.expert_ffn] if moe else [a.ffn])
    if mla:
        widths = [a.hidden, a.expert_ffn, a.ffn, a.kv_lora, a.qk_nope, a.heads * a.v_dim] + [a.q_lora] * bool(a.q_lora)
    if any(width % block for width in widths):
        p.error(f"--type {a.type} needs every matrix width (hidden, heads x head_dim, "
                f"ffn or expert-ffn) to be a multiple of {block}")
    source = a.tokenizer_from or DEFAULT_MODEL
    copy = a.tokenizer == "copy" or (a.tokenizer == "auto" and (
        a.tokenizer_from is not None or (DEFAULT_MODEL.exists() and a.vocab is None)))

    w = gguf.GGUFWriter(a.out, a.arch)
    w.add_name(f"random {a.arch} {a.hidden}x{a.layers}")
    w.add_context_length(a.context)
    w.add_embedding_length(a.hidden)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(1 if mla else a.kv_heads)
    w.add_rope_dimension_count(a.qk_rope if mla else head_dim)
    if mla:  # as llama.cpp's converter writes it since its MLA change
        w.add_kv_lora_rank(a.kv_lora)
        if a.q_lora:
            w.add_q_lora_rank(a.q_lora)
        w.add_key_length(a.kv_lora + a.qk_rope)
        w.add_value_length(a.kv_lora)
        w.add_key_length_mla(a.qk_nope + a.qk_rope)
        w.add_value_length_mla(a.v_dim)
        w.add_leading_dense_block_count(a.dense_lead)
        w.add_expert_shared_count(a.shared_experts)
        w.add_expert_weights_scale(1.0)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        if a.yarn_factor:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(a.yarn_factor)
            w.add_rope_scaling_orig_ctx_len(4096)
            w.add_rope_scaling_yarn_log_mul(0.1 * 0.707)
    elif a.head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if moe:
        w.add_expert_count(a.experts)
        w.add_expert_used_count(a.experts_used)
        w.add_expert_feed_forward_length(a.expert_ffn)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(FILE_TYPES[a.type])
    if a.type != "f16":  # llama-quantize writes it; left out of f16 files as before
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if copy:
        vocab = copy_tokenizer(w, source)
        if asked_vocab not in (None, vocab):
            p.error(f"{source} has {vocab} tokens, not --vocab {asked_vocab}")
    else:
        vocab = a.vocab or 49152
        write_minimal_tokenizer(w, vocab)
    w.add_vocab_size(vocab)

    # The plan: (name, numpy shape, type); generated and written one at a time below.
    kv, q = a.kv_heads * head_dim, a.heads * head_dim
    plan = [("token_embd.weight", (vocab, a.hidden)), ("output_norm.weight", (a.hidden,))]
    if not a.tied:
        plan.append(("output.weight", (vocab, a.hidden)))
    if a.rope_freqs:
        plan.append(("rope_freqs.weight", (head_dim // 2,)))
    for i in range(a.layers):
        if mla:
            plan += mla_layer_plan(a, i)
            continue
        plan += [(f"blk.{i}.{n}", s) for n, s in [
            ("attn_norm.weight", (a.hidden,)), ("attn_q.weight", (q, a.hidden)),
            ("attn_k.weight", (kv, a.hidden)), ("attn_v.weight", (kv, a.hidden)),
            ("attn_output.weight", (a.hidden, q)), ("ffn_norm.weight", (a.hidden,))]]
        if a.arch == "qwen3moe":  # Qwen3's per-head q/k norms
            plan += [(f"blk.{i}.{n}", (head_dim,)) for n in ["attn_q_norm.weight", "attn_k_norm.weight"]]
        if moe:  # the router, the stacked experts
            e, f = a.experts, a.expert_ffn
            plan += [(f"blk.{i}.{n}", s) for n, s in [
                ("ffn_gate_inp.weight", (e, a.hidden)), ("ffn_gate_exps.weight", (e, f, a.hidden)),
                ("ffn_up_exps.weight", (e, f, a.hidden)), ("ffn_down_exps.weight", (e, a.hidden, f))]]
        else:
            plan += [(f"blk.{i}.{n}", s) for n, s in [
                ("ffn_gate.weight", (a.ffn, a.hidden)), ("ffn_up.weight", (a.ffn, a.hidden)),
                ("ffn_down.weight", (a.hidden, a.ffn))]]
    typed = []
    for name, shape in plan:
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        # llama-quantize keeps norms and the MoE router in F32.
        keep_f32 = len(shape) == 1 or name.endswith("ffn_gate_inp.weight")
        qtype = T.F32 if keep_f32 else tensor_type(a.type, name, layer, a.layers, a.tied)
        typed.append((name, shape, qtype))
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(shape) // block * size
        if qtype in (T.F32, T.F16):
            w.add_tensor_info(name, shape, np.dtype(np.float32 if qtype == T.F32 else np.float16), nbytes)
        else:  # raw blocks: numpy byte shape (..., rows, bytes per row), converted by the writer
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8),
                              nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    rng = np.random.default_rng(a.seed)
    blocks = Blocks(rng)
    began, total, counts = time.time(), 0, {}
    for name, shape, qtype in typed:
        if name == "rope_freqs.weight":
            data = llama31_rope_freqs(head_dim, a.rope_theta)
        elif name.endswith("ffn_gate_inp.weight"):  # router logits of std ~1 on normed rows
            data = rng.standard_normal(shape, dtype=np.float32) / math.sqrt(shape[-1])
        elif qtype == T.F32:
            data = np.ones(shape, dtype=np.float32)
        elif qtype == T.F16:  # by row chunks (same values as one draw), less memory
            data = np.empty(shape, dtype=np.float16)
            rows = data.reshape(-1, shape[-1])
            step = max(1, (1 << 26) // shape[-1])
            for r in range(0, rows.shape[0], step):
                n = min(step, rows.shape[0] - r)
                rows[r:r + n] = rng.standard_normal((n, shape[-1]), dtype=np.float32) * STD
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            data = blocks.make(qtype, math.prod(shape) // block).reshape(*shape[:-1], -1)
        w.write_tensor_data(data)
        total += data.nbytes
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
        del data
    w.close()
    mix = ", ".join(f"{n} {t}" for t, n in counts.items())
    print(f"wrote {a.out}: {vocab} tokens ({'copied from ' + str(source) if copy else 'minimal'}), "
          f"{len(typed)} tensors ({mix}), {total / 1e9:.2f} GB in {time.time() - began:.1f} s")
    if a.verify:
        verify(a.out)


if __name__ == "__main__":
    main()
