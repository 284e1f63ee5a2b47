"""The Python path: its small ops in numpy and its layers, as Hugging Face's reference computes them."""

from __future__ import annotations

import numpy as np

from fdcore.models import cpu_env  # noqa: F401  (before paddle: math-library settings)

# isort: split
import paddle

from fdcore.models.kv_cache import PagedKVCache
from fdcore.models.matrices import (
    linear,
    paddle_silu_mul,
    swiglu,
)
from fdcore.models.tensors import as_paddle


def rms_norm_np(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """HF's RMSNorm over the last axis of a numpy array (hidden states, Qwen3's per-head q / k)."""
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(variance + np.float32(eps))) * weight


def rms_norm(x: paddle.Tensor, weight: np.ndarray, eps: float) -> paddle.Tensor:
    """HF's RMSNorm, in numpy (five tiny Paddle ops cost ~10x more than the arithmetic)."""
    return as_paddle(rms_norm_np(x.numpy(), weight, eps))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """HF's rotate-half rotary embedding: x * cos + rotate_half(x) * sin (a new array)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class PythonLayers:
    """The model's layers on the Python path (a mixin of fdcore.models.llama.LlamaModel): numpy for the small
    per-token work, Paddle's matmuls over gathered cache blocks; the reference the fused operators match."""

    def _layer_forward(self, hidden, layer, index, cos, sin, plan, cache):
        a = self.args
        x = rms_norm(hidden, layer["in_norm"], a.rms_norm_eps)
        qkv = linear(x, layer["qkv"], layer.get("qkv_bias"))
        # Small per-token work (rotary, scaling, head shuffles) is cheaper in numpy
        # than as a dozen Paddle ops; the big products stay in Paddle.
        heads = qkv.numpy().reshape(-1, a.num_heads + 2 * a.num_kv_heads, a.head_dim)
        qk = heads[:, : a.num_heads + a.num_kv_heads]
        if a.qk_norm:
            qk = np.concatenate(
                [
                    rms_norm_np(qk[:, : a.num_heads], layer["q_norm"], a.rms_norm_eps),
                    rms_norm_np(qk[:, a.num_heads :], layer["k_norm"], a.rms_norm_eps),
                ],
                axis=1,
            )
        qk = apply_rope(qk, cos[:, None, :], sin[:, None, :])
        q = qk[:, : a.num_heads] * np.float32(self.scale)
        cache.write(index, plan.write_slots, qk[:, a.num_heads :], heads[:, a.num_heads + a.num_kv_heads :])
        attn = as_paddle(self._attention(q, index, cache, plan, layer["window"]))
        hidden = hidden + self._row_parallel(attn, layer["o"], layer.get("o_bias"))
        x = rms_norm(hidden, layer["post_norm"], a.rms_norm_eps)
        activations = swiglu(x, layer["gate_up"], layer.get("gate_up_bias"), paddle_silu_mul)
        return hidden + self._row_parallel(activations, layer["down"], layer.get("down_bias"))

    def _attention(self, q: np.ndarray, layer: int, cache: PagedKVCache, plan, window: int) -> np.ndarray:
        """Attention output [tokens, heads * head_dim] for scaled queries ``q`` [tokens, heads, dim]
        (the Python path: per-sequence gathers and Paddle matmuls)."""
        parts = []
        if plan.num_decode:
            parts.append(self._decode_attention(q[: plan.num_decode], layer, cache, plan, window))
        for start, end, blocks, biases in plan.prefills:
            parts.append(self._prefill_attention(q[start:end], layer, cache, blocks, biases[window]))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _decode_attention(self, q, layer, cache, plan, window):
        a = self.args
        b, groups = plan.num_decode, a.num_heads // a.num_kv_heads
        k, v = (
            as_paddle(x).reshape([a.num_kv_heads, b, -1, a.head_dim]) for x in cache.gather(layer, plan.decode_blocks)
        )
        q = as_paddle(np.ascontiguousarray(q.reshape(b, a.num_kv_heads, groups, a.head_dim).transpose(1, 0, 2, 3)))
        scores = paddle.matmul(q, k, transpose_y=True)  # [kv, b, g, L]
        probs = paddle.nn.functional.softmax(scores + plan.decode_bias[window], axis=-1)
        out = paddle.matmul(probs, v).numpy()  # [kv, b, g, D]
        return np.ascontiguousarray(out.transpose(1, 0, 2, 3)).reshape(b, a.num_heads * a.head_dim)

    def _prefill_attention(self, q, layer, cache, blocks, bias):
        a = self.args
        n, groups = q.shape[0], a.num_heads // a.num_kv_heads
        k, v = (as_paddle(x) for x in cache.gather(layer, blocks))  # [kv, L, D]
        q = np.ascontiguousarray(q.reshape(n, a.num_kv_heads, groups, a.head_dim).transpose(1, 2, 0, 3))
        scores = paddle.matmul(
            as_paddle(q.reshape(a.num_kv_heads, groups * n, a.head_dim)), k, transpose_y=True
        )  # [kv, g*n, L]
        scores = scores.reshape([a.num_kv_heads, groups, n, -1]) + bias
        probs = paddle.nn.functional.softmax(scores, axis=-1).reshape([a.num_kv_heads, groups * n, -1])
        out = paddle.matmul(probs, v).numpy().reshape(a.num_kv_heads, groups, n, a.head_dim)
        return np.ascontiguousarray(out.transpose(2, 0, 1, 3)).reshape(n, a.num_heads * a.head_dim)
