"""An independent numpy forward pass of a llama-family GGUF (float64 activations over the
dequantized weights) giving llama-server's `--embedding` vector: the last layer's hidden
states after the final RMSNorm, mean-pooled over the tokens, L2-normalised.

Used by test_embeddings.py as the oracle for /v1/embeddings; needs numpy and gguf.
"""

import numpy as np
import gguf


def _field(reader, key):
    field = reader.fields[key]
    return field.parts[field.data[0]][0].item()


class Reference:
    def __init__(self, path):
        reader = gguf.GGUFReader(path)
        arch = "llama"
        self.layers = int(_field(reader, f"{arch}.block_count"))
        self.heads = int(_field(reader, f"{arch}.attention.head_count"))
        self.kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv"))
        self.eps = float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon"))
        self.base = float(_field(reader, f"{arch}.rope.freq_base"))
        self.w = {}
        for tensor in reader.tensors:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            self.w[tensor.name] = np.asarray(values, dtype=np.float64)

    def _norm(self, x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def _rope(self, x, positions):
        # GGUF stores llama's q/k rows permuted for adjacent-pair rotation.
        head_dim = x.shape[-1]
        inv = self.base ** (-np.arange(0, head_dim, 2) / head_dim)
        angle = positions[:, None, None] * inv[None, None, :]
        cos, sin = np.cos(angle), np.sin(angle)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def hidden(self, tokens):
        """The final-normed hidden states, [len(tokens), hidden]."""
        w = self.w
        n = len(tokens)
        x = w["token_embd.weight"][np.asarray(tokens)]
        positions = np.arange(n, dtype=np.float64)
        mask = np.triu(np.full((n, n), -np.inf), 1)
        group = self.heads // self.kv_heads
        for i in range(self.layers):
            p = f"blk.{i}."
            h = self._norm(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).reshape(n, self.heads, -1)
            k = (h @ w[p + "attn_k.weight"].T).reshape(n, self.kv_heads, -1)
            v = (h @ w[p + "attn_v.weight"].T).reshape(n, self.kv_heads, -1)
            q, k = self._rope(q, positions), self._rope(k, positions)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1]) + mask
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", scores, v).reshape(n, -1)
            x = x + attn @ w[p + "attn_output.weight"].T
            h = self._norm(x, w[p + "ffn_norm.weight"])
            gate = h @ w[p + "ffn_gate.weight"].T
            up = h @ w[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        return self._norm(x, w["output_norm.weight"])

    def logits(self, tokens):
        head = self.w.get("output.weight", self.w["token_embd.weight"])
        return self.hidden(tokens) @ head.T

    def embedding(self, tokens):
        pooled = self.hidden(tokens).mean(axis=0)
        return pooled / np.linalg.norm(pooled)
