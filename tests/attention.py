"""The attention_block operator run on random sequences, for the attention tests (float32 and bfloat16 caches)."""

from __future__ import annotations

import types

import numpy as np

from fdcore.models.kernels import operators


def attend(heads: int, kv_heads: int, dim: int, block: int, window: int, lengths: list[int], dtype: str, seed: int):
    """The attention_block operator over sequences of ``lengths`` tokens, prefilled whole (no rotation: cos
    1, sin 0): returns (its output [T, heads, dim], q scaled, k, v as float32 [T, heads|kv_heads, dim], the
    row -> (sequence, position) map)."""
    import paddle

    from fdcore.models.kv_cache import PagedKVCache

    rng = np.random.default_rng(seed)
    total = sum(lengths)
    blocks_each = [-(-n // block) for n in lengths]
    order = rng.permutation(sum(blocks_each))  # scattered block ids
    tables, start = [], 0
    for count in blocks_each:
        tables.append(order[start : start + count].tolist())
        start += count
    width = max(blocks_each)
    args = types.SimpleNamespace(num_kv_heads=kv_heads, head_dim=dim, num_layers=1)
    cache = PagedKVCache(args, sum(blocks_each), block, dtype)
    qkv = (rng.standard_normal((total, (heads + 2 * kv_heads) * dim)) * 2).astype(np.float32)
    rows, slots, table_rows, row_lengths = [], [], [], []
    for seq, n in enumerate(lengths):
        for pos in range(n):
            rows.append((seq, pos))
            slots.append(tables[seq][pos // block] * block + pos % block)
            table_rows.append(tables[seq] + [0] * (width - len(tables[seq])))
            row_lengths.append(pos + 1)
    scale = dim**-0.5
    k_cache, v_cache = cache.tensors(0)
    out = (
        operators()
        .attention_block(
            paddle.to_tensor(qkv),
            paddle.ones([total, dim // 2]),
            paddle.zeros([total, dim // 2]),
            paddle.to_tensor(np.array(slots, dtype=np.int64)),
            k_cache,
            v_cache,
            paddle.to_tensor(np.array(table_rows, dtype=np.int64)),
            paddle.to_tensor(np.array(row_lengths, dtype=np.int64)),
            paddle.empty([0], dtype="float32"),
            paddle.empty([0], dtype="float32"),
            heads,
            scale,
            window,
            1e-6,
        )
        .numpy()
        .reshape(total, heads, dim)
    )
    split = qkv.reshape(total, heads + 2 * kv_heads, dim)
    q = split[:, :heads] * np.float32(scale)
    return out, q, split[:, heads : heads + kv_heads], split[:, heads + kv_heads :], rows


def reference(q, k, v, rows, heads: int, kv_heads: int, window: int, rounded=None) -> np.ndarray:
    """Softmax(q . k) v of each row over its keys (its last ``window`` where window > 0), in float64, past the
    kernel's roundings where ``rounded`` is given (float32 -> float64: applied to q, k, v and the softmax's
    weights e = exp(s - max) before the weighted sum, which is divided by the sum of the unrounded e)."""
    rounded = rounded or (lambda array: np.asarray(array, dtype=np.float64))
    q, k, v = rounded(q), rounded(k), rounded(v)
    out = np.zeros(q.shape)
    first_row = {}
    for t, (seq, _pos) in enumerate(rows):
        first_row.setdefault(seq, t)
    for t, (seq, pos) in enumerate(rows):
        begin = max(0, pos + 1 - window) if window else 0
        keys = slice(first_row[seq] + begin, first_row[seq] + pos + 1)
        for h in range(heads):
            j = h // (heads // kv_heads)
            scores = k[keys, j] @ q[t, h]
            e = np.exp(scores - scores.max())
            out[t, h] = rounded(e.astype(np.float32)) @ v[keys, j] / e.sum()
    return out
