"""Llama-family decoder (Llama, Mistral, Qwen2) in Paddle over a paged KV cache.

One :meth:`LlamaModel.forward` runs a whole step: a batch of sequences at
different positions, some prefilling a chunk of several tokens, others decoding
one. Each sequence brings its block table; the KV cache of each layer is one
contiguous ``[num_blocks * block_size, kv_heads, head_dim]`` tensor, written by
slot index and read by gathering slots (``index_select`` returns a contiguous
tensor: no strided views of the cache in the hot path).

NOTE: decoding sequences are attended in one batched matmul over their
contexts padded to the longest (masked), prefill chunks one sequence at a time
with a causal mask offset by what the cache already holds. The batch is
reordered internally (decodes first) and logits come back in the caller's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from fdcore.models.loader import Checkpoint, ModelArgs

DTYPES = {"float32": paddle.float32, "bfloat16": paddle.bfloat16, "float16": paddle.float16}


@dataclass
class BatchInput:
    """One step's work, per sequence (the scheduler fills it)."""

    token_ids: list[list[int]]   # the new tokens of each sequence this step
    start_positions: list[int]   # position of each sequence's first new token
    block_tables: list[list[int]]

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)


class PagedKVCache:
    """K and V of every layer, as flat slot-indexed tensors."""

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype=paddle.float32):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = [num_blocks * block_size, args.num_kv_heads, args.head_dim]
        self.k = [paddle.zeros(shape, dtype=dtype) for _ in range(args.num_layers)]
        self.v = [paddle.zeros(shape, dtype=dtype) for _ in range(args.num_layers)]

    def slots(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        """Slot index of each position in [start, end) of one sequence."""
        positions = np.arange(start, end)
        table = np.asarray(block_table, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size


class LlamaModel:
    """The weights (as Paddle tensors, projections stored [in, out]) and the forward pass."""

    def __init__(self, checkpoint: Checkpoint, dtype: str = "float32"):
        self.args = args = checkpoint.args
        self.dtype = DTYPES[dtype]
        t = checkpoint.tensors
        self.embed = self._tensor(t["model.embed_tokens.weight"])
        self.norm = self._tensor(t["model.norm.weight"])
        head = t["model.embed_tokens.weight"] if args.tie_word_embeddings else t["lm_head.weight"]
        self.lm_head = self._tensor(np.ascontiguousarray(head.T))
        self.layers = [self._layer(t, i) for i in range(args.num_layers)]
        half = args.head_dim // 2
        self.inv_freq = (1.0 / (args.rope_theta ** (np.arange(0, half * 2, 2, dtype=np.float32)
                                                    / (half * 2)))).astype(np.float32)
        self.scale = args.head_dim ** -0.5

    def _tensor(self, array: np.ndarray) -> paddle.Tensor:
        return paddle.to_tensor(np.ascontiguousarray(array), dtype=self.dtype)

    def _layer(self, t: dict, i: int) -> dict:
        p = f"model.layers.{i}."
        w = lambda name: self._tensor(t[p + name + ".weight"].T)  # noqa: E731  [in, out]
        q, k, v = (t[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        layer = {
            "qkv": self._tensor(np.concatenate([q, k, v]).T),
            "o": w("self_attn.o_proj"),
            "gate_up": self._tensor(np.concatenate([t[p + "mlp.gate_proj.weight"],
                                                    t[p + "mlp.up_proj.weight"]]).T),
            "down": w("mlp.down_proj"),
            "in_norm": self._tensor(t[p + "input_layernorm.weight"]),
            "post_norm": self._tensor(t[p + "post_attention_layernorm.weight"]),
        }
        if self.args.qkv_bias:
            layer["qkv_bias"] = self._tensor(np.concatenate(
                [t[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
        return layer

    # ------------------------------------------------------------------ forward
    @paddle.no_grad()
    def forward(self, batch: BatchInput, cache: PagedKVCache) -> np.ndarray:
        """Logits of each sequence's last new token, [num_seqs, vocab] float32, caller's order."""
        order = sorted(range(batch.num_seqs), key=lambda s: len(batch.token_ids[s]) != 1)
        plan = _Plan(batch, order, cache)
        hidden = paddle.index_select(self.embed, paddle.to_tensor(plan.token_ids))
        cos, sin = self._rope(plan.positions)
        for index, layer in enumerate(self.layers):
            hidden = self._layer_forward(hidden, layer, index, cos, sin, plan, cache)
        last = paddle.index_select(hidden, paddle.to_tensor(plan.last_rows))
        logits = paddle.matmul(_rms_norm(last, self.norm, self.args.rms_norm_eps), self.lm_head)
        out = np.empty((batch.num_seqs, self.args.vocab_size), dtype=np.float32)
        out[order] = logits.astype(paddle.float32).numpy()
        return out

    def _layer_forward(self, hidden, layer, index, cos, sin, plan, cache):
        a = self.args
        x = _rms_norm(hidden, layer["in_norm"], a.rms_norm_eps)
        qkv = paddle.matmul(x, layer["qkv"])
        if "qkv_bias" in layer:
            qkv = qkv + layer["qkv_bias"]
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q, k, v = paddle.split(qkv, [q_size, kv_size, kv_size], axis=-1)
        q = _apply_rope(q.reshape([-1, a.num_heads, a.head_dim]), cos, sin)
        k = _apply_rope(k.reshape([-1, a.num_kv_heads, a.head_dim]), cos, sin)
        v = v.reshape([-1, a.num_kv_heads, a.head_dim])
        slots = paddle.to_tensor(plan.write_slots)
        paddle.scatter_(cache.k[index], slots, k, overwrite=True)
        paddle.scatter_(cache.v[index], slots, v, overwrite=True)
        attn = self._attention(q, cache.k[index], cache.v[index], plan)
        hidden = hidden + paddle.matmul(attn, layer["o"])
        x = _rms_norm(hidden, layer["post_norm"], a.rms_norm_eps)
        gate, up = paddle.split(paddle.matmul(x, layer["gate_up"]), 2, axis=-1)
        return hidden + paddle.matmul(paddle.nn.functional.silu(gate) * up, layer["down"])

    def _attention(self, q, k_cache, v_cache, plan) -> paddle.Tensor:
        parts = []
        if plan.num_decode:
            parts.append(self._decode_attention(q[:plan.num_decode], k_cache, v_cache, plan))
        for start, end, slots, mask in plan.prefills:
            parts.append(self._prefill_attention(q[start:end], k_cache, v_cache, slots, mask))
        return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)

    def _decode_attention(self, q, k_cache, v_cache, plan):
        a = self.args
        b, length, groups = plan.num_decode, plan.decode_len, a.num_heads // a.num_kv_heads
        slots = paddle.to_tensor(plan.decode_slots.reshape(-1))
        k = paddle.index_select(k_cache, slots).reshape([b, length, a.num_kv_heads, a.head_dim])
        v = paddle.index_select(v_cache, slots).reshape([b, length, a.num_kv_heads, a.head_dim])
        q = q.reshape([b, a.num_kv_heads, groups, a.head_dim])
        scores = paddle.matmul(q, k.transpose([0, 2, 3, 1])) * self.scale  # [b, kv, g, L]
        scores = scores + paddle.to_tensor(plan.decode_bias, dtype=scores.dtype)
        probs = paddle.nn.functional.softmax(scores, axis=-1)
        out = paddle.matmul(probs, v.transpose([0, 2, 1, 3]))  # [b, kv, g, D]
        return out.reshape([b, a.num_heads * a.head_dim])

    def _prefill_attention(self, q, k_cache, v_cache, slots, bias):
        a = self.args
        n, groups = q.shape[0], a.num_heads // a.num_kv_heads
        index = paddle.to_tensor(slots)
        k = paddle.index_select(k_cache, index).transpose([1, 2, 0])  # [kv, D, L]
        v = paddle.index_select(v_cache, index).transpose([1, 0, 2])  # [kv, L, D]
        q = q.reshape([n, a.num_kv_heads, groups, a.head_dim]).transpose([1, 2, 0, 3])  # [kv, g, n, D]
        scores = paddle.matmul(q, k.unsqueeze(1)) * self.scale  # [kv, g, n, L]
        scores = scores + paddle.to_tensor(bias, dtype=scores.dtype)
        probs = paddle.nn.functional.softmax(scores, axis=-1)
        out = paddle.matmul(probs, v.unsqueeze(1))  # [kv, g, n, D]
        return out.transpose([2, 0, 1, 3]).reshape([n, a.num_heads * a.head_dim])

    def _rope(self, positions: np.ndarray):
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        cos = paddle.to_tensor(np.cos(freqs)[:, None, :], dtype=self.dtype)
        sin = paddle.to_tensor(np.sin(freqs)[:, None, :], dtype=self.dtype)
        return cos, sin


class _Plan:
    """Index arrays for one step, built once in numpy (decodes first, then prefills)."""

    def __init__(self, batch: BatchInput, order: list[int], cache: PagedKVCache):
        tokens, positions, write, last, self.prefills = [], [], [], [], []
        decode = [s for s in order if len(batch.token_ids[s]) == 1]
        row = 0
        for s in order:
            ids, start = batch.token_ids[s], batch.start_positions[s]
            end = start + len(ids)
            tokens.extend(ids)
            positions.extend(range(start, end))
            write.append(cache.slots(batch.block_tables[s], start, end))
            if len(ids) > 1:
                self.prefills.append((row, row + len(ids), cache.slots(batch.block_tables[s], 0, end),
                                      _causal_bias(start, end)))
            row += len(ids)
            last.append(row - 1)
        self.token_ids = np.asarray(tokens, dtype=np.int64)
        self.positions = np.asarray(positions, dtype=np.int64)
        self.write_slots = np.concatenate(write) if write else np.zeros(0, np.int64)
        self.last_rows = np.asarray(last, dtype=np.int64)
        self.num_decode = len(decode)
        if decode:
            self._plan_decode(batch, decode, cache)

    def _plan_decode(self, batch, decode, cache) -> None:
        lengths = [batch.start_positions[s] + 1 for s in decode]
        self.decode_len = length = max(lengths)
        self.decode_slots = np.zeros((len(decode), length), dtype=np.int64)
        self.decode_bias = np.full((len(decode), 1, 1, length), -np.inf, dtype=np.float32)
        for i, (s, n) in enumerate(zip(decode, lengths)):
            self.decode_slots[i, :n] = cache.slots(batch.block_tables[s], 0, n)
            self.decode_bias[i, ..., :n] = 0.0


def _causal_bias(start: int, end: int) -> np.ndarray:
    """[n, end] additive mask: new token i (at position start + i) sees keys 0 .. start + i."""
    keys = np.arange(end)[None, :]
    queries = np.arange(start, end)[:, None]
    return np.where(keys <= queries, 0.0, -np.inf).astype(np.float32)


def _rms_norm(x, weight, eps):
    variance = paddle.mean(x.astype(paddle.float32) ** 2, axis=-1, keepdim=True)
    return (x.astype(paddle.float32) * paddle.rsqrt(variance + eps)).astype(x.dtype) * weight


def _apply_rope(x, cos, sin):
    """HF's rotate-half rotary embedding: x * cos + rotate_half(x) * sin."""
    x1, x2 = paddle.split(x, 2, axis=-1)
    return paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
