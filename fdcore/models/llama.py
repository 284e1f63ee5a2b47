"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in Paddle over a paged KV cache.

One :meth:`LlamaModel.forward` runs a whole step: a batch of sequences at
different positions, some prefilling a chunk of several tokens, others decoding
one. Each sequence brings its block table.

NOTE: on the CPU the KV cache lives in numpy arrays laid out head-major,
``[kv_heads, num_blocks, block_size, head_dim]`` per layer (a float32 cache's keys
transposed within each block: see PagedKVCache): gathering a sequence's blocks
(``np.take`` on axis 1) yields ``[kv_heads, blocks, block_size, head_dim]`` already
contiguous, which Paddle's matmul needs. Paddle's own gather
copies ~6x slower, and any strided view fed to its matmul (a transpose, a slice)
costs 10-50x a contiguous one, so every such view is materialised first.
Decoding sequences are attended in one batched matmul over their contexts
padded to the longest (masked); prefill chunks one sequence at a time with a
causal mask offset by what the cache already holds. The batch is reordered
internally (decodes first) and logits come back in the caller's order.

The variants differ only in small ways, each a flag of ModelArgs: biases on
q/k/v (Qwen2, ``attention_bias``), on o (``attention_bias``) and on the MLP
(``mlp_bias``), Qwen3's per-head RMSNorm of q and k, sliding-window layers
(Mistral, Qwen2/3) and the rotary scaling type (fdcore.checkpoint.rope).
"""

from __future__ import annotations

import msgspec
import numpy as np

from fdcore.models import cpu_env  # noqa: F401  (before paddle: math-library settings)
import paddle  # noqa: E402

from fdcore.core.batch import BatchInput
from fdcore.models.kernels import DECODER_KINDS, DECODER_META, DECODER_SLOTS
from fdcore.checkpoint import Checkpoint, ModelArgs
from fdcore.checkpoint.ggml_blocks import Blocks, concatenate_rows
from fdcore.models.shared_weights import Stored, WeightFile, shared_pages_cost
from fdcore.models.tensor_parallel import GATHER_ROWS, TensorGroup
from fdcore.models.tensors import (StepInputs, arrays_in_file, as_paddle, on_huge_pages, packing_shared,
                                   packing_weights, release_pages, zeros_on_huge_pages)


class PagedKVCache:
    """K and V of every layer: numpy ``[kv_heads, num_blocks, block_size, head_dim]``, in float32 or (``dtype
    "bfloat16"``, held as int16 bits) bfloat16: half the memory a token, and attention's products in
    AVX512-BF16's ``vdpbf16ps`` (attention_bf16.h's AttendHeadsBf16; only fdcore's C++ operators read it).

    A float32 cache's keys are transposed within each block, ``[kv_heads, num_blocks, head_dim, block_size]``:
    a key a vector lane, so attention's scores are one FMA chain per key (attention_avx512.h's ScoreRuns) with no
    reduction across lanes. (The bfloat16 cache keeps its keys as rows: its kernel multiplies them in pairs of
    values along head_dim, and this machine's CPU, without AVX512-BF16, could not run a re-laid one.)

    With ``fd`` (the rank's KV file, which the supervisor holds: ``cache.shared_memory``) the arrays live in
    that shared file instead of private huge pages, and outlive the worker: its successor finds every block
    its predecessor computed, and the cache manager's prefix cache still points at them."""

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: str = "float32",
                 fd: int | None = None):
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"PagedKVCache: dtype {dtype!r}: 'float32' or 'bfloat16'")
        self.num_blocks, self.block_size, self.dtype, self.shared = num_blocks, block_size, dtype, fd is not None
        storage = np.float32 if dtype == "float32" else np.int16
        shape = (args.num_kv_heads, num_blocks, block_size, args.head_dim)
        k_shape = (args.num_kv_heads, num_blocks, args.head_dim, block_size) if dtype == "float32" else shape
        if fd is not None:
            arrays = arrays_in_file(fd, [k_shape, shape] * args.num_layers, storage)
            self.k, self.v = arrays[0::2], arrays[1::2]
        else:
            self.k = [zeros_on_huge_pages(k_shape, storage) for _ in range(args.num_layers)]
            self.v = [zeros_on_huge_pages(shape, storage) for _ in range(args.num_layers)]
        self._k_buffer = self._v_buffer = self._kt_buffer = np.empty(0, dtype=storage)
        self._views: tuple[list[paddle.Tensor], list[paddle.Tensor]] | None = None

    def release(self) -> None:
        """The arrays' memory back to the kernel until they are written again (a warm spare's cache, which
        its warm-up touched): their contents are lost, which no sequence reads before it writes them. A
        shared cache is never released: its contents are the rank's, which the serving worker reads."""
        if self.shared:
            return
        for array in self.k + self.v:
            release_pages(array)

    def all_tensors(self) -> tuple[list[paddle.Tensor], list[paddle.Tensor]]:
        """Paddle views (no copy, made once) of every layer's K arrays, and of its V arrays."""
        if self._views is None:
            view = as_paddle if self.dtype == "float32" else (lambda bits: as_paddle(bits).view(paddle.bfloat16))
            self._views = [view(k) for k in self.k], [view(v) for v in self.v]
        return self._views

    def tensors(self, layer: int) -> tuple[paddle.Tensor, paddle.Tensor]:
        """One layer's K and V views, for the paged attention op."""
        k, v = self.all_tensors()
        return k[layer], v[layer]

    def slots(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        """Slot index (block * block_size + offset) of each position in [start, end)."""
        positions = np.arange(start, end)
        table = np.asarray(block_table, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store new K/V rows ([tokens, kv_heads, head_dim]) at their slots."""
        self._float32_only()
        blocks, offsets = np.divmod(slots, self.block_size)
        self.k[layer][:, blocks, :, offsets] = k  # (indexed [tokens, kv_heads, head_dim]: the arrays' axes first)
        self.v[layer][:, blocks, offsets] = v.transpose(1, 0, 2)

    def gather(self, layer: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The listed blocks, contiguous: [kv_heads, len(blocks) * block_size, head_dim].

        NOTE: the result lives in buffers that the next call overwrites (use it
        first). Fresh multi-megabyte arrays per layer cost more in page faults
        than the copy itself (measured: 20 ms vs 5 ms per step at batch 64), and
        ``mode="clip"`` keeps np.take from staging ``out`` through a temporary.
        """
        self._float32_only()
        heads, _, size, dim = self.v[layer].shape
        shape = (heads, len(blocks), size, dim)
        need = heads * len(blocks) * size * dim
        if self._k_buffer.size < need:
            self._k_buffer, self._v_buffer, self._kt_buffer = (np.empty(need, dtype=np.float32) for _ in range(3))
        k = self._k_buffer[:need].reshape(shape)
        v = self._v_buffer[:need].reshape(shape)
        kt = self._kt_buffer[:need].reshape(heads, len(blocks), dim, size)
        np.take(self.k[layer], blocks, axis=1, out=kt, mode="clip")
        np.copyto(k, kt.transpose(0, 1, 3, 2))  # the blocks' keys as rows again
        np.take(self.v[layer], blocks, axis=1, out=v, mode="clip")
        return k.reshape(heads, -1, dim), v.reshape(heads, -1, dim)

    def _float32_only(self) -> None:
        if self.dtype != "float32":  # (the Python path's; a bfloat16 model has fdcore's operators or is refused)
            raise RuntimeError("a bfloat16 KV cache is read and written by fdcore's C++ operators only")


class LlamaModel:
    """The weights (as Paddle tensors) and the forward pass.

    Projections are packed for fdcore's kernels (F32Matrix, Bf16Matrix, Int8Matrix,
    Int4Matrix; see ``linear``). Where float32 has no kernel (neither AVX-512F nor AVX2) they keep
    Hugging Face's ``[out, in]`` layout and are applied with
    ``matmul(x, w, transpose_y=True)``: with MKL that is 1.4-1.7x faster than
    the same product on an ``[in, out]`` copy (0.61 vs 0.86 ms, 1.8 vs 3.1 ms
    for the 4096-wide head at batch 64).
    """

    def __init__(self, checkpoint: Checkpoint, dtype: str = "float32", quantization: str = "none",
                 group: TensorGroup | None = None, shared: WeightFile | None = None):
        """``group``: this rank's place in a tensor-parallel worker group (its shard of a checkpoint cut by
        fdcore.models.tensor_parallel, and the group's communicator); None: the whole model here.
        ``shared``: the rank's weight file (fdcore.models.shared_weights): attached, the weights are mapped
        from it (``checkpoint.tensors`` unused); else they are packed into it and published there, as far
        as it has room (``shared.full`` says where it had none)."""
        self.args = args = checkpoint.args
        self.group = group
        self.dtype = paddle.float32
        self.matrix_dtype = _matrix_kind(dtype, quantization)  # projections: float32, bfloat16, wint8, wint4
        self.f32_kernel = self.matrix_dtype == "float32" and _f32_kernel()  # float32 as F32Matrix
        # NOTE: the checkpoint's arrays are taken (popped) as they become the model's tensors, so
        # loading peaks at the weights plus one layer, not two copies of everything.
        if shared is not None and shared.manifest is not None:
            self._map_weights(shared)
        else:
            with packing_weights(None if shared is None else shared.take):  # (fdcore.models.tensors)
                self._take_weights(checkpoint)
            if shared is not None and shared.full is None:
                shared.publish(msgspec.msgpack.encode(self._weights_manifest(shared)))
        self.windows = tuple(sorted({layer["window"] for layer in self.layers}))  # the masks a step needs
        self.scale = args.head_dim ** -0.5
        from fdcore.models.kernels import operators

        self.fused = operators()  # fdcore's operators, or None: the Python path
        self.no_tensor = paddle.empty([0], dtype=paddle.float32)
        if self.fused is not None:
            self.norm_t = as_paddle(self.norm)
            for layer in self.layers:
                layer["in_norm_t"] = as_paddle(layer["in_norm"])
                layer["post_norm_t"] = as_paddle(layer["post_norm"])
        # the one-call decoder sums a rank's o and down products itself through a shared-memory communicator;
        # a rank of another communicator (paddle.distributed) runs the layers one by one
        self.decoder_group = group.decoder_args() if group is not None else None
        one_call = self.fused is not None and (group is None or self.decoder_group is not None)
        self.decoder = self._decoder_plan() if one_call else None
        self.step_inputs = StepInputs()
        self.prefetch_timing = self.tune_weight_prefetch()

    def new_cache(self, num_blocks: int, block_size: int, dtype: str = "auto", fd: int | None = None) -> PagedKVCache:
        """A KV cache for this model in ``dtype`` as :meth:`cache_dtype` resolves it (in the shared file ``fd``:
        see :class:`PagedKVCache`)."""
        return PagedKVCache(self.args, num_blocks, block_size, self.cache_dtype(dtype), fd)

    def cache_dtype(self, requested: str = "auto") -> str:
        """The KV cache dtype ``requested`` (config key ``cache.dtype``) means for this model: "auto" is bfloat16
        for a bfloat16 model whose heads the bfloat16 attention takes (head_dim a multiple of 32), as vLLM's
        "auto" is the model's dtype, and float32 otherwise; "bfloat16" is refused where the attention cannot
        read it."""
        why_not = self._bf16_attention()
        if requested == "auto":
            return "bfloat16" if self.matrix_dtype == "bfloat16" and why_not is None else "float32"
        if requested == "bfloat16" and why_not:
            raise ValueError(f"cache.dtype is 'bfloat16', which {why_not}: use 'float32' or 'auto'")
        return requested

    def _bf16_attention(self) -> str | None:
        """Why this model's attention cannot read a bfloat16 cache here (None: it can)."""
        from fdcore.models.kernels import missing_cpu_feature

        if self.fused is None:
            return "needs fdcore's C++ operators (not built here)"
        missing = missing_cpu_feature("bfloat16")
        if missing:
            return f"needs a CPU with {missing}"
        if self.args.head_dim % 32:
            return f"needs head_dim a multiple of 32 (this model's is {self.args.head_dim})"
        return None

    def tune_weight_prefetch(self, rounds: int = 8, bytes_per_round: int = 160 << 20) -> dict | None:
        """Set the kernels' weight prefetch (fdcore.models.kernels.set_weight_prefetch: float32, int8 and int4
        one-row passes) to whichever of on and off makes one pass of one row over every such matrix of the
        model faster here (each pass streams them from memory, as a batch-1 decode step does); {on: median
        seconds, off: ...}. None for a model with no such matrix (bfloat16) or without the kernels. The bits
        are the same either way. Fewer rounds where a pass streams more than ``bytes_per_round``
        (tuning.rounds_for: a load's time is a restart's pause; the worker re-tries the other value as it decodes)."""
        from fdcore.models.kernels import set_weight_prefetch
        from fdcore.models.tuning import fastest, rounds_for

        streamed = (F32Matrix, Int8Matrix, Int4Matrix)
        matrices = [m for layer in self.layers for m in layer.values() if isinstance(m, streamed)]
        matrices += [self.lm_head] if isinstance(self.lm_head, streamed) else []
        if not matrices or not set_weight_prefetch(True):
            return None
        rows = {width: paddle.ones([1, width], dtype=paddle.float32) for width in {m.inputs for m in matrices}}
        streamed_bytes = sum(_nbytes(m) for m in matrices)  # (a pass's bytes: SmolLM2 float32's 538 MB, 3 rounds)
        rounds = rounds_for(rounds, streamed_bytes, bytes_per_round)

        def one_pass() -> None:
            for matrix in matrices:
                linear(rows[matrix.inputs], matrix)

        _, medians = fastest((True, False), set_weight_prefetch, one_pass, rounds)
        return medians

    def _take_weights(self, checkpoint: Checkpoint) -> None:
        """The embedding, LM head, final norm and layers, packed from the checkpoint's arrays."""
        args = self.args
        t, file_blocks = checkpoint.tensors, checkpoint.blocks  # both taken (popped) as the model builds
        embed = t.pop("model.embed_tokens.weight")
        # NOTE: wint4 keeps the LM head in int8, as llama.cpp's 4-bit files keep output.weight at 6-8 bits
        # and GPTQ / AWQ leave it unquantized: on SmolLM2 a 4-bit head moved the logits by up to 4.6
        # (int8: 1.6) and changed float32's greedy token at 14 steps of 144 (int8: 3).
        head_kind = "wint8" if self.matrix_dtype == "wint4" else self.matrix_dtype
        if args.tie_word_embeddings and head_kind == "float32":
            # one copy for both: a plain tensor, or an F32Matrix whose rows the embedding reads (``_embed``)
            self.embed = self.lm_head = self._matrix(embed)
            self.embed_rows = None if isinstance(self.embed, F32Matrix) else np.from_dlpack(self.embed)
        else:
            self.embed_rows = _weight32(embed)  # (what _embed_rows gathers from: the tensor's memory)
            self.embed = as_paddle(self.embed_rows)
            head_name = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
            self.lm_head = self._matrix(embed if args.tie_word_embeddings else t.pop(head_name), head_kind,
                                        _blocks_of(file_blocks, head_name))
        del embed
        self.norm = _weight32(t.pop("model.norm.weight"))
        self.layers = [self._layer(t, file_blocks, i) for i in range(args.num_layers)]

    def _decoder_plan(self):
        """``(op, weights, meta, kind)`` for the one-call decoder (kernels/decoder.cc: every layer of a step
        in one operator, the same kernels in the same order, so the same bits as ``_fused_layers``'s
        per-layer calls, without their ~8 dispatches a layer); None when it is not built or the layers'
        projections are not all of one packed kind (float32 left to MKL on CPUs without AVX2)."""
        from fdcore.models.kernels import decoder_layers

        op = decoder_layers()
        kinds = {type(layer[name]) for layer in self.layers for name in _PROJECTIONS}
        if op is None or len(kinds) != 1 or next(iter(kinds)) not in _KIND_CODES:
            return None
        if kinds == {Bf16Matrix} and not all(layer["gate_up"].gated for layer in self.layers):
            raise RuntimeError("decoder_layers takes a bfloat16 model's gate_up gated (Bf16Matrix.pack_gated)")
        weights, meta = [], []
        for layer in self.layers:
            weights += [self._slot_tensor(layer, slot) for slot in DECODER_SLOTS]
            meta += [layer[name].rows for name in DECODER_META[:-1]] + [layer["window"]]
        return op, weights, meta, _KIND_CODES[kinds.pop()], self._decoder_head()

    def _slot_tensor(self, layer: dict, slot: str) -> paddle.Tensor:
        """A layer's tensor for the one-call decoder's slot ``slot`` (DECODER_SLOTS); an empty one where it has none."""
        name, _, part = slot.rpartition("_") if slot.endswith(("_scales", "_bias")) else (slot, "", "")
        if name in _PROJECTIONS:
            matrix = layer[name]
            if part == "":
                return matrix.packed
            return getattr(matrix, "scales", self.no_tensor) if part == "scales" else layer.get(slot, self.no_tensor)
        if slot in ("in_norm", "post_norm"):
            return layer[f"{slot}_t"]
        return layer.get(f"{slot}_t", self.no_tensor)  # (q_norm, k_norm: Qwen3's)

    def _decoder_head(self):
        """The LM head as the one-call decoder takes it (see its ``head``), or None where ``_head`` must make
        the logits: a group's rank (its slice, gathered) or a head of a kind decoder.cc does not multiply."""
        head = self.lm_head
        if self.group is not None or type(head) not in _KIND_CODES:
            return None
        none = self.no_tensor
        return [head.packed, getattr(head, "scales", none), none], _KIND_CODES[type(head)], head.rows

    def _weights_manifest(self, shared: WeightFile) -> "WeightsManifest":
        """Where each of the weights lies in ``shared``, into which they were packed (see _map_weights)."""
        def entry(value):
            parts = _PARTS.get(type(value))
            if parts is None:
                return _stored(shared, value)
            return StoredMatrix(type(value).__name__, [_stored(shared, part) for part in parts(value)], value.rows,
                                getattr(value, "gated", False))

        tied = self.embed is self.lm_head
        return WeightsManifest(self._packed_for(), tied, entry(self.embed), None if self.embed_rows is None or tied else
                               _stored(shared, self.embed_rows), entry(self.lm_head), _stored(shared, self.norm),
                               [{name: entry(value) for name, value in layer.items()} for layer in self.layers])

    def _packed_for(self) -> str:
        return f"{self.matrix_dtype} (float32 kernel: {self.f32_kernel}) {self.args!r}"

    def _map_weights(self, shared: WeightFile) -> None:
        """The weights as another process packed them into ``shared`` (_weights_manifest), mapped where they lie."""
        manifest = msgspec.msgpack.decode(shared.manifest, type=WeightsManifest)
        if manifest.model != self._packed_for():
            raise RuntimeError(f"the shared weights were packed for {manifest.model}, not {self._packed_for()}")

        def value(entry):
            if entry is None or isinstance(entry, int):
                return entry
            if isinstance(entry, Stored):
                array = shared.array(entry)
                return as_paddle(array) if entry.tensor else array
            parts = [shared.array(part) for part in entry.parts]
            if entry.kind == "F32Matrix":
                return F32Matrix(parts[0], entry.rows)
            tensors = [as_paddle(part) for part in parts]
            if entry.kind == "Bf16Matrix":
                return Bf16Matrix(tensors[0].view(paddle.bfloat16), entry.rows, entry.gated)
            return (Int8Matrix if entry.kind == "Int8Matrix" else Int4Matrix)(*tensors, entry.rows)

        self.embed = value(manifest.embed)
        self.lm_head = self.embed if manifest.tied else value(manifest.lm_head)
        if manifest.embed_rows is not None:
            self.embed_rows = shared.array(manifest.embed_rows)
        else:
            self.embed_rows = None if isinstance(self.embed, F32Matrix) else np.from_dlpack(self.embed)
        self.norm = shared.array(manifest.norm)
        self.layers = [{name: value(entry) for name, entry in layer.items()} for layer in manifest.layers]

    def _matrix(self, array: np.ndarray, kind: str | None = None, blocks: Blocks | None = None):
        """A projection's weight [out, in] as the model multiplies it, in ``kind`` (default: the model's
        matrix dtype; bfloat16, wint8 and wint4 packed for fdcore's kernels, see Bf16Matrix, Int8Matrix
        and Int4Matrix; float32 too (F32Matrix) where its kernel runs, else a plain tensor for MKL).
        ``blocks``: the same weight as a GGUF file quantized it, packed level for level when ``kind`` holds
        its levels (the file's exact weights, not the float32 array quantized again: see _HOLDS_BLOCKS)."""
        kind = kind or self.matrix_dtype
        if kind == "float32":
            return F32Matrix.pack(array) if self.f32_kernel else as_paddle(_weight32(array))
        if blocks is not None and blocks.kind in _HOLDS_BLOCKS.get(kind, ()):
            return _PACKED[kind].from_blocks(blocks)
        return _PACKED[kind].pack(array)

    def _embed(self, token_ids: np.ndarray) -> np.ndarray:
        """The embedding's rows for these tokens, [tokens, hidden] (a new array)."""
        if self.group is not None:
            return self.group.embed(self._embed_rows, token_ids)
        return self._embed_rows(token_ids)

    def _embed_rows(self, token_ids: np.ndarray) -> np.ndarray:
        # numpy's gather: Paddle's index_select cost ~0.1 ms more a decode step
        if isinstance(self.embed, F32Matrix):
            return self.embed.take_rows(token_ids)
        return np.take(self.embed_rows, token_ids, axis=0)

    def _head(self, states: paddle.Tensor) -> np.ndarray:
        """The LM head's logits, [rows, vocab] float32 (a group's rank: its slice, then everyone's gathered)."""
        if self.group is None:
            return linear(states, self.lm_head).numpy()
        return np.concatenate([self.group.comm.gather(linear(states[first:first + GATHER_ROWS], self.lm_head).numpy())
                               for first in range(0, max(states.shape[0], 1), GATHER_ROWS)])

    def _row_parallel(self, x: paddle.Tensor, matrix, bias) -> paddle.Tensor:
        """An output projection (o, down): in a group, each rank's partial product, summed."""
        y = linear(x, matrix, bias)
        return y if self.group is None else as_paddle(self.group.comm.all_reduce(y.numpy()))

    def _layer(self, t: dict, file_blocks: dict[str, Blocks], i: int) -> dict:
        p = f"model.layers.{i}."
        take = lambda name: t.pop(p + name)  # noqa: E731  [out, in] for projections
        a = self.args
        def stacked(*names: str):  # weights multiplied as one: stacked by rows
            arrays = [take(name) for name in names]
            array = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            return self._matrix(array, blocks=_blocks_of(file_blocks, *(p + name for name in names)))

        def gate_up():  # bfloat16: gated, SwiGLU in the product's epilogue (Bf16Matrix.pack_gated)
            names = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
            if self.matrix_dtype != "bfloat16":
                return stacked(*names)
            _blocks_of(file_blocks, *(p + name for name in names))  # (taken: bfloat16 holds no file's blocks)
            return Bf16Matrix.pack_gated(*(take(name) for name in names))

        layer = {
            "qkv": stacked(*(f"self_attn.{n}_proj.weight" for n in "qkv")),
            "o": stacked("self_attn.o_proj.weight"),
            "gate_up": gate_up(),
            "down": stacked("mlp.down_proj.weight"),
            "in_norm": _weight32(take("input_layernorm.weight")),
            "post_norm": _weight32(take("post_attention_layernorm.weight")),
            "window": a.window(i),
        }
        if a.qkv_bias:
            layer["qkv_bias"] = as_paddle(_weight32(np.concatenate([take(f"self_attn.{n}_proj.bias") for n in "qkv"])))
        if a.o_bias:
            layer["o_bias"] = as_paddle(_weight32(take("self_attn.o_proj.bias")))
        if a.mlp_bias:
            layer["gate_up_bias"] = as_paddle(_weight32(np.concatenate([take("mlp.gate_proj.bias"),
                                                                        take("mlp.up_proj.bias")])))
            layer["down_bias"] = as_paddle(_weight32(take("mlp.down_proj.bias")))
        if a.qk_norm:
            layer["q_norm"] = _weight32(take("self_attn.q_norm.weight"))
            layer["k_norm"] = _weight32(take("self_attn.k_norm.weight"))
            layer["q_norm_t"], layer["k_norm_t"] = as_paddle(layer["q_norm"]), as_paddle(layer["k_norm"])
        return layer

    # ------------------------------------------------------------------ forward
    @paddle.no_grad()
    def forward(self, batch: BatchInput, cache: PagedKVCache) -> np.ndarray:
        """Logits of each sequence's last new token, [num_seqs, vocab] float32, caller's order."""
        return self.forward_rows(batch, cache, ())[0]

    def forward_rows(self, batch: BatchInput, cache: PagedKVCache,
                     every_row_of: tuple[int, ...]) -> tuple[np.ndarray, dict[int, paddle.Tensor]]:
        """:meth:`forward`'s logits, and for each sequence (index into ``batch``) in ``every_row_of``
        the final hidden state of every new token, [tokens, hidden] (prompt scoring turns them
        into logits a slice at a time with :meth:`logits`: a long prompt's logits at once would
        be tokens x vocab floats)."""
        order = sorted(range(batch.num_seqs), key=lambda s: len(batch.token_ids[s]) != 1)
        plan = _Plan(batch, order, cache, masks=self.fused is None, windows=self.windows)
        hidden = self._embed(plan.token_ids)
        cos, sin = self.args.rope.tables(plan.positions, plan.rope_lengths(batch, order)
                                         if self.args.rope.is_dynamic else None)
        rows = {s: plan.rows_of(order.index(s)) for s in every_row_of}
        if self.fused is not None:
            normed, logits = self._fused_layers(hidden, cos, sin, plan, cache)
            logits = (self._head(paddle.index_select(normed, as_paddle(plan.last_rows))) if logits is None
                      else logits.numpy())
            states = {s: normed[first:end] for s, (first, end) in rows.items()}
        else:
            hidden = as_paddle(hidden)
            for index, layer in enumerate(self.layers):
                hidden = self._layer_forward(hidden, layer, index, cos, sin, plan, cache)
            last = paddle.index_select(hidden, paddle.to_tensor(plan.last_rows))
            logits = self._head(_rms_norm(last, self.norm, self.args.rms_norm_eps))
            states = {s: _rms_norm(hidden[first:end], self.norm, self.args.rms_norm_eps)
                      for s, (first, end) in rows.items()}
        if order == list(range(batch.num_seqs)) and logits.dtype == np.float32:
            return logits, states  # (a new array already: no second copy of a vocabulary's floats a row)
        out = np.empty((batch.num_seqs, self.args.vocab_size), dtype=np.float32)
        out[order] = logits
        return out, states

    def logits(self, states: paddle.Tensor) -> np.ndarray:
        """The LM head over final hidden states (from :meth:`forward_rows`), [rows, vocab] float32."""
        return self._head(states)

    def _fused_layers(self, hidden, cos, sin, plan, cache) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        """Every layer with fdcore's fused operators: each residual add travels with the next
        RMSNorm, rotary + cache write + attention are one op, SwiGLU is one op; 7 operator calls
        per layer instead of ~25 (or all of them in one: the one-call decoder). Returns the final
        norm's output (all rows), and the logits of the plan's last rows where the one-call decoder
        made them (else None). The small index arrays go over as views (``as_paddle``), not copies."""
        ops = self.fused
        add_rms_norm, silu_mul, attention_block = ops.add_rms_norm, ops.silu_mul, ops.attention_block
        a = self.args
        eps = a.rms_norm_eps
        if self.decoder is not None:
            op, weights, meta, kind, head = self.decoder
            inputs = self.step_inputs.views((hidden, cos, sin, plan.write_slots, *plan.row_arrays(), plan.last_rows))
            return op(*inputs, *cache.all_tensors(), weights, self.norm_t, meta, kind, a.num_heads, self.scale, eps,
                      self.decoder_group, head)
        hidden, cos_t, sin_t, slots = as_paddle(hidden), as_paddle(cos), as_paddle(sin), as_paddle(plan.write_slots)
        tables, lengths = (as_paddle(array) for array in plan.row_arrays())
        delta, none = self.no_tensor, self.no_tensor
        for index, layer in enumerate(self.layers):
            hidden, x = add_rms_norm(hidden, delta, layer["in_norm_t"], eps)
            qkv = linear(x, layer["qkv"], layer.get("qkv_bias"))
            k, v = cache.tensors(index)
            attn = attention_block(qkv, cos_t, sin_t, slots, k, v, tables, lengths, layer.get("q_norm_t", none),
                                   layer.get("k_norm_t", none), a.num_heads, self.scale, layer["window"], eps)
            hidden, x = add_rms_norm(hidden, self._row_parallel(attn, layer["o"], layer.get("o_bias")),
                                     layer["post_norm_t"], eps)
            activations = swiglu(x, layer["gate_up"], layer.get("gate_up_bias"), silu_mul)
            delta = self._row_parallel(activations, layer["down"], layer.get("down_bias"))
        return add_rms_norm(hidden, delta, self.norm_t, eps)[1], None

    def _layer_forward(self, hidden, layer, index, cos, sin, plan, cache):
        a = self.args
        x = _rms_norm(hidden, layer["in_norm"], a.rms_norm_eps)
        qkv = linear(x, layer["qkv"], layer.get("qkv_bias"))
        # Small per-token work (rotary, scaling, head shuffles) is cheaper in numpy
        # than as a dozen Paddle ops; the big products stay in Paddle.
        heads = qkv.numpy().reshape(-1, a.num_heads + 2 * a.num_kv_heads, a.head_dim)
        qk = heads[:, :a.num_heads + a.num_kv_heads]
        if a.qk_norm:
            qk = np.concatenate([_rms_norm_np(qk[:, :a.num_heads], layer["q_norm"], a.rms_norm_eps),
                                 _rms_norm_np(qk[:, a.num_heads:], layer["k_norm"], a.rms_norm_eps)], axis=1)
        qk = _apply_rope(qk, cos[:, None, :], sin[:, None, :])
        q = qk[:, :a.num_heads] * np.float32(self.scale)
        cache.write(index, plan.write_slots, qk[:, a.num_heads:], heads[:, a.num_heads + a.num_kv_heads:])
        attn = as_paddle(self._attention(q, index, cache, plan, layer["window"]))
        hidden = hidden + self._row_parallel(attn, layer["o"], layer.get("o_bias"))
        x = _rms_norm(hidden, layer["post_norm"], a.rms_norm_eps)
        activations = swiglu(x, layer["gate_up"], layer.get("gate_up_bias"), _silu_mul)
        return hidden + self._row_parallel(activations, layer["down"], layer.get("down_bias"))

    def _attention(self, q: np.ndarray, layer: int, cache: PagedKVCache, plan, window: int) -> np.ndarray:
        """Attention output [tokens, heads * head_dim] for scaled queries ``q`` [tokens, heads, dim]
        (the Python path: per-sequence gathers and Paddle matmuls)."""
        parts = []
        if plan.num_decode:
            parts.append(self._decode_attention(q[:plan.num_decode], layer, cache, plan, window))
        for start, end, blocks, biases in plan.prefills:
            parts.append(self._prefill_attention(q[start:end], layer, cache, blocks, biases[window]))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _decode_attention(self, q, layer, cache, plan, window):
        a = self.args
        b, groups = plan.num_decode, a.num_heads // a.num_kv_heads
        k, v = (as_paddle(x).reshape([a.num_kv_heads, b, -1, a.head_dim])
                for x in cache.gather(layer, plan.decode_blocks))
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
        scores = paddle.matmul(as_paddle(q.reshape(a.num_kv_heads, groups * n, a.head_dim)), k,
                               transpose_y=True)  # [kv, g*n, L]
        scores = scores.reshape([a.num_kv_heads, groups, n, -1]) + bias
        probs = paddle.nn.functional.softmax(scores, axis=-1).reshape([a.num_kv_heads, groups * n, -1])
        out = paddle.matmul(probs, v).numpy().reshape(a.num_kv_heads, groups, n, a.head_dim)
        return np.ascontiguousarray(out.transpose(2, 0, 1, 3)).reshape(n, a.num_heads * a.head_dim)


class _Plan:
    """Index arrays for one step, built once in numpy (decodes first, then prefills)."""

    def __init__(self, batch: BatchInput, order: list[int], cache: PagedKVCache, masks: bool = True,
                 windows: tuple[int, ...] = (0,)):
        tokens, positions, write, last, self.prefills = [], [], [], [], []
        self._rows = []  # (block table, first position, token count) per sequence, in row order
        self._row_arrays = None
        row, size = 0, cache.block_size
        for s in order:
            ids, start = batch.token_ids[s], batch.start_positions[s]
            end = start + len(ids)
            tokens.extend(ids)
            positions.extend(range(start, end))
            self._rows.append((batch.block_tables[s], start, len(ids)))
            if len(ids) == 1:  # a decode: its one slot, without numpy's per-call overhead
                write.append((batch.block_tables[s][start // size] * size + start % size,))
            else:
                write.append(cache.slots(batch.block_tables[s], start, end))
            if len(ids) > 1 and masks:  # (the paged kernel needs no masks)
                blocks = _blocks_for(batch.block_tables[s], end, cache.block_size)
                biases = {w: paddle.to_tensor(_causal_bias(start, end, len(blocks) * cache.block_size, w))
                          for w in windows}
                self.prefills.append((row, row + len(ids), blocks, biases))
            row += len(ids)
            last.append(row - 1)
        self.token_ids = np.asarray(tokens, dtype=np.int64)
        self.positions = np.asarray(positions, dtype=np.int64)
        self.write_slots = np.fromiter((slot for part in write for slot in part), dtype=np.int64)
        self.last_rows = np.asarray(last, dtype=np.int64)
        self._counts = [len(batch.token_ids[s]) for s in order]
        decode = [s for s in order if len(batch.token_ids[s]) == 1]
        self.num_decode = len(decode)
        if decode and masks:
            self._plan_decode(batch, decode, cache.block_size, windows)

    def rows_of(self, place: int) -> tuple[int, int]:
        """The rows (first, end) of the ``place``-th sequence in row order."""
        end = int(self.last_rows[place]) + 1
        return end - self._counts[place], end

    def rope_lengths(self, batch: BatchInput, order: list[int]) -> np.ndarray:
        """Per row, the sequence length its rotary frequencies are for (dynamic scaling):
        max(position + 1, prompt length), or the end of the sequence's tokens in this step
        when the caller gave no prompt lengths (the same for a prompt prefilled whole)."""
        counts = [len(batch.token_ids[s]) for s in order]
        if batch.prompt_lengths is None:
            ends = [batch.start_positions[s] + n for s, n in zip(order, counts, strict=True)]
            return np.repeat(np.asarray(ends, dtype=np.int64), counts)
        prompts = np.repeat(np.asarray([batch.prompt_lengths[s] for s in order], dtype=np.int64), counts)
        return np.maximum(self.positions + 1, prompts)

    def row_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row: its sequence's block table (padded) and how many keys it sees (position + 1)."""
        if self._row_arrays is None:
            total = sum(count for _, _, count in self._rows)
            width = max(len(table) for table, _, _ in self._rows)
            tables = np.zeros((total, width), dtype=np.int64)
            lengths = np.empty(total, dtype=np.int64)
            row = 0
            for table, start, count in self._rows:
                tables[row:row + count, :len(table)] = table
                lengths[row:row + count] = np.arange(start + 1, start + count + 1)
                row += count
            self._row_arrays = (tables, lengths)
        return self._row_arrays

    def _plan_decode(self, batch, decode, block_size, windows) -> None:
        """Every decode sequence padded to the same number of blocks, the padding (and keys
        outside a sliding window) masked."""
        lengths = np.asarray([batch.start_positions[s] + 1 for s in decode])
        width = -(-int(lengths.max()) // block_size)
        blocks = np.zeros((len(decode), width), dtype=np.int64)
        for i, s in enumerate(decode):
            table = batch.block_tables[s][:width]
            blocks[i, :len(table)] = table
        self.decode_blocks = blocks.reshape(-1)
        self.decode_bias = {window: paddle.to_tensor(_attention_bias(lengths - 1, width * block_size, window)
                                                     .reshape(1, len(decode), 1, -1)) for window in windows}


def _blocks_for(block_table: list[int], length: int, block_size: int) -> np.ndarray:
    return np.asarray(block_table[:-(-length // block_size)], dtype=np.int64)


def _causal_bias(start: int, end: int, width: int, window: int = 0) -> np.ndarray:
    """[n, width] additive mask: new token i (at position start + i) sees keys 0 .. start + i
    (only the last ``window`` of them when window > 0)."""
    return _attention_bias(np.arange(start, end), width, window)


def _attention_bias(positions: np.ndarray, width: int, window: int) -> np.ndarray:
    """[len(positions), width] additive mask: a query at position p sees keys 0 .. p, or only
    p - window + 1 .. p when window > 0 (the paged kernel's rule)."""
    keys = np.arange(width)[None, :]
    queries = positions[:, None]
    seen = keys <= queries
    if window:
        seen &= keys > queries - window
    return np.where(seen, 0.0, -np.inf).astype(np.float32)


class F32Matrix:
    """A float32 weight ``[out, in]`` packed for fdcore's kernel (linear_f32.cc): panels of 32 output rows,
    ``[panels, in, 32]`` (``packed[p, k, lane] = weight[32 p + lane, k]``; 16 rows per 64-byte load),
    the last panel zero-padded. The same values as the weight, in another order: a tied model's
    embedding reads its rows from here (``take_rows``) instead of keeping a second copy.

    NOTE: used for every float32 projection and the LM head at every batch size, where the CPU has
    AVX-512F: no row count was found where MKL's matmul is faster, so there is no threshold to
    dispatch on (and a fallback would need the unpacked copy too: twice the memory). Measured
    (benchmarks/bench_linear_f32.py: SmolLM2-135M's 30 layers' products and its 49152-row head, 538 MB,
    ms per token step, MKL / kernel; EPYC Zen 4, 2 cores):

        rows of x        1      4      8     16     32     64    512
        1 thread     37/19  63/21  72/25  91/45 126/84 210/166 1352/1292  (kernel faster 1.9-3.0x to 1.05x)
        2 threads    37/16  47/17  53/17  63/29  81/53 119/87   682/654   (2.2-3.1x to 1.04x)

    At 2048 rows (a step's most, max_num_batched_tokens) each shape alone is within 4% either way
    (both near the core's peak, ~100 GFLOP/s); the head only ever sees a step's last rows."""

    __slots__ = ("array", "packed", "rows")

    def __init__(self, array: np.ndarray, rows: int):
        self.array, self.rows = array, rows
        self.packed = as_paddle(array)  # shares the array's memory

    @classmethod
    def pack(cls, weight: np.ndarray) -> "F32Matrix":
        rows, cols = weight.shape
        full, panels = rows // 32, -(-rows // 32)
        array = zeros_on_huge_pages((panels, cols, 32), np.float32)
        # NOTE: in slices of 64 panels, so the transposed copy's source stays in cache
        for start in range(0, full, 64):
            end = min(full, start + 64)
            array[start:end] = weight[start * 32:end * 32].reshape(end - start, 32, cols).transpose(0, 2, 1)
        if full < panels:
            tail = np.zeros((32, cols), dtype=np.float32)
            tail[:rows - full * 32] = weight[full * 32:]
            array[full] = tail.T
        return cls(array, rows)

    @property
    def inputs(self) -> int:
        """The inner dimension (x's width)."""
        return self.array.shape[1]

    def take_rows(self, ids: np.ndarray) -> np.ndarray:
        """``weight[ids]``, [len(ids), in] (a new array)."""
        return np.ascontiguousarray(self.array[ids // 32, :, ids % 32])

    def numel(self) -> int:
        """The float32 values held (padding included), as a tensor's ``numel``: memory accounting."""
        return self.array.size


class Bf16Matrix:
    """A weight ``[out, in]`` in bfloat16, packed for fdcore's kernel (linear_bf16.cc): groups of 32
    output rows, each ``[in / 2, 2, 16, 2]`` (16 rows x 2 inputs per 64-byte load), zero-padded.
    ``gated``: an MLP's gate and up projections for the kernel's SwiGLU (pack_gated, swiglu)."""

    __slots__ = ("packed", "rows", "gated")

    def __init__(self, packed: paddle.Tensor, rows: int, gated: bool = False):
        self.packed, self.rows, self.gated = packed, rows, gated

    @classmethod
    def pack_gated(cls, gate: np.ndarray, up: np.ndarray) -> "Bf16Matrix":
        """The gate and up projections (``[I, in]`` each) with group g holding the gate's rows 16 g .. 16 g + 15,
        then the up projection's same rows (zeros past I): a group's two 16-output blocks are then one block's
        gate and up, and the kernel stores silu(gate) up from its registers (linear_bf16.cc, SwiGluOut) where the
        [rows, 2 I] product used to go through memory and a SwiGLU pass. ``rows``: 2 I, as a stacked gate_up's."""
        inner, cols = gate.shape
        blocks = -(-inner // 16)
        interleaved = np.zeros((blocks, 2, 16, cols), dtype=np.float32)
        for half, weight in enumerate((gate, up)):
            padded = np.zeros((blocks * 16, cols), dtype=np.float32)
            padded[:inner] = weight
            interleaved[:, half] = padded.reshape(blocks, 16, cols)
        return cls(cls.pack(interleaved.reshape(blocks * 32, cols)).packed, 2 * inner, gated=True)

    @classmethod
    def pack(cls, weight: np.ndarray) -> "Bf16Matrix":
        rows, cols = weight.shape
        padded = np.zeros((-(-rows // 32) * 32, cols + cols % 2), dtype=np.float32)
        padded[:rows, :cols] = weight
        groups, pairs = padded.shape[0] // 32, padded.shape[1] // 2
        blocks = padded.reshape(groups, 2, 16, pairs, 2).transpose(0, 3, 1, 2, 4)
        bits = paddle.to_tensor(np.ascontiguousarray(blocks)).astype("bfloat16").numpy().view(np.int16)
        # int16 through DLPack, then viewed (no copy) as bfloat16: a uint16 array would come through
        # as a tensor Python calls bfloat16 but the kernels see as uint16
        return cls(as_paddle(on_huge_pages(bits)).view(paddle.bfloat16), rows)


class Int8Matrix:
    """A weight ``[out, in]`` quantized to 8 bits per output row and block of 32 inputs (wint8): ``w ~=
    scale[row, block] * u + minimum[row, block]``, u in [0, 255], scale and minimum in float16 (llama.cpp's
    Q4_1 form with 8-bit levels; a Q8_0 file's ``d * q`` is ``u = q + 128`` with ``minimum = -128 d``,
    exactly), packed for fdcore's kernel (linear_int8.cc): groups of 64 output rows (32 on AVX2:
    kernels.int8_group_rows), each ``[in / 4, rows / 16, 16, 4]`` (16 rows x 4 inputs per 64-byte load),
    zero-padded to whole groups and to a multiple of 32 inputs; scales ``[groups, in / 32, 2, group rows]``:
    per block the group's scales, then its minimums (float16 as int16 bits: 4 bytes a block where float32
    would add 12.5 % more to the bytes a batch-1 step streams).

    Why a minimum: a block's 256 levels span its range [min, max] rather than [-max |w|, max |w|], and a
    file's 4-bit blocks (Q4_1, Q4_0, Q4_K) are this form as they are (LlamaModel._matrix takes them).
    Quantized from SmolLM2's float weights (with 16-bit activations), symmetric int8 levels changed
    float32's greedy token on 2 of 9 golden prompts within 16 tokens (a float64 simulation), this grid on
    1 (a top-two gap of 0.002), the file's own levels on none (benchmarks/bench_quality.py)."""

    __slots__ = ("packed", "scales", "rows")

    def __init__(self, packed: paddle.Tensor, scales: paddle.Tensor, rows: int):
        self.packed, self.scales, self.rows = packed, scales, rows

    @property
    def inputs(self) -> int:
        """The inner dimension it was packed with (a multiple of 32, as x may be)."""
        return self.packed.shape[1] * 4

    @staticmethod
    def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(u uint8 [out, in'] in [0, 255], scale and minimum float32 [out, in' / 32], each a float16
        value) with weight ~= scale * u + minimum block by block, off by at most scale / 2 (in' = in
        rounded up to 32, padded with zeros)."""
        return _asymmetric_levels(weight, 255, "wint8")

    @classmethod
    def pack(cls, weight: np.ndarray) -> "Int8Matrix":
        return cls.pack_levels(*cls.quantize(weight))

    @classmethod
    def from_blocks(cls, blocks: Blocks) -> "Int8Matrix":
        """A GGUF file's Q8_0 weight, level for level (fdcore.checkpoint.ggml_blocks): ``u = q + 128`` and
        ``minimum = -128 scale`` (exact in float16 but for scales beyond 511, which are quantized again);
        or its 4-bit one (Q4_1, Q4_0, Q4_K), whose levels, scales and minimums are wint8's as they are."""
        if blocks.minimum is not None:
            return cls.pack_levels(blocks.levels, blocks.scale, blocks.minimum)
        minimum = np.float32(-128) * blocks.scale
        if not np.isfinite(minimum.astype(np.float16)).all():
            return cls.pack(blocks.dequantized())
        return cls.pack_levels((blocks.levels.astype(np.int16) + 128).astype(np.uint8), blocks.scale, minimum)

    @classmethod
    def pack_levels(cls, u: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> "Int8Matrix":
        """Pack levels ``u`` (uint8 [out, in], in a multiple of 32) with their per-block scales and minimums."""
        from fdcore.models.kernels import int8_group_rows

        rows, cols = u.shape
        group = int8_group_rows()  # the kernel path's (64 rows for AVX512-VNNI, 32 for AVX2)
        padded = np.zeros((-(-rows // group) * group, cols), dtype=np.uint8)
        padded[:rows] = u
        groups, quads = padded.shape[0] // group, cols // 4
        blocks = padded.reshape(groups, group // 16, 16, quads, 4).transpose(0, 3, 1, 2, 4)
        values = np.zeros((padded.shape[0], cols // 32, 2), dtype=np.float32)
        values[:rows, :, 0], values[:rows, :, 1] = scale, minimum
        values = values.reshape(groups, group, cols // 32, 2).transpose(0, 2, 3, 1).astype(np.float16).view(np.int16)
        return cls(as_paddle(on_huge_pages(blocks)), as_paddle(on_huge_pages(values)), rows)


class Int4Matrix:
    """A weight ``[out, in]`` quantized to 4 bits per output row and block of 32 inputs (wint4, llama.cpp's
    Q4_1: ``w ~= scale[row, block] * q + minimum[row, block]``, q in [0, 15], scale and minimum in
    float16: 5 bits a weight), packed for fdcore's kernel (linear_int4.cc) as one uint8 tensor
    ``[groups, in / 32, 640]``: groups of 32 output rows (zero-padded), and per group and block of 32
    inputs one contiguous record of 512 bytes of nibbles ``[4, 2, 16, 4]`` (16 rows x 8 inputs per
    64-byte load: the low nibble holds input ``8 v + j``, the high one ``8 v + 4 + j``) followed by
    the 32 rows' float16 scales and then their 32 float16 minimums; the inner dimension is
    zero-padded to a multiple of 32."""

    __slots__ = ("packed", "rows")

    def __init__(self, packed: paddle.Tensor, rows: int):
        self.packed, self.rows = packed, rows

    @property
    def inputs(self) -> int:
        """The inner dimension it was packed with (a multiple of 32, as x may be)."""
        return self.packed.shape[1] * 32

    @staticmethod
    def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q uint8 [out, in'] in [0, 15], scale and minimum float32 [out, in' / 32], each a float16
        value) with weight ~= scale * q + minimum block by block (in' = in rounded up to 32, padded
        with zeros). The minimum is rounded down and the scale up to float16, so that every weight
        lies within [minimum, minimum + 15 scale] and is off by at most scale / 2."""
        return _asymmetric_levels(weight, 15, "wint4")

    @classmethod
    def pack(cls, weight: np.ndarray) -> "Int4Matrix":
        return cls._pack_slices(weight.shape[0], lambda part: cls.quantize(weight[part]))

    @classmethod
    def from_blocks(cls, blocks: Blocks) -> "Int4Matrix":
        """A GGUF file's Q4_1, Q4_0 or Q4_K weight, level for level (fdcore.checkpoint.ggml_blocks)."""
        return cls._pack_slices(blocks.levels.shape[0], lambda part: (blocks.levels[part], blocks.scale[part],
                                                                      blocks.minimum[part]))

    @classmethod
    def _pack_slices(cls, rows: int, quantized) -> "Int4Matrix":
        """Pack ``quantized(rows slice) -> (q, scale, minimum)`` (see :meth:`quantize`) slice by slice."""
        groups, packed = -(-rows // 32), None
        # NOTE: in slices of rows, so the temporaries stay small (and in cache) for the 49152-row head;
        # each slice's records go straight to their place in the packed matrix
        for start in range(0, rows, 2048):
            records = cls._records(*quantized(slice(start, start + 2048)))
            if packed is None:
                packed = zeros_on_huge_pages((groups, *records.shape[1:]), np.uint8)
            packed[start // 32:start // 32 + records.shape[0]] = records
        return cls(as_paddle(packed), rows)

    @classmethod
    def _records(cls, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> np.ndarray:
        """The packed records [groups, in' / 32, 640] of a slice of rows (a multiple of 32 but the last)."""
        rows, cols = q.shape
        groups, blocks = -(-rows // 32), cols // 32
        if rows % 32:
            q = np.concatenate([q, np.zeros((groups * 32 - rows, cols), dtype=np.uint8)])
            scale, minimum = (np.concatenate([a, np.zeros((groups * 32 - rows, blocks), dtype=np.float32)])
                              for a in (scale, minimum))
        halves = q.reshape(groups, 2, 16, blocks, 4, 2, 4)  # [g, b, lane, block, v, half, j]
        nibbles = (halves[:, :, :, :, :, 0] | (halves[:, :, :, :, :, 1] << 4)).transpose(0, 3, 4, 1, 2, 5)
        per_block = [nibbles.reshape(groups, blocks, 512)]
        for values in (scale, minimum):
            halfs = values.astype(np.float16).reshape(groups, 32, blocks).transpose(0, 2, 1)
            per_block.append(np.ascontiguousarray(halfs).view(np.uint8))
        return np.concatenate(per_block, axis=2)


def _asymmetric_levels(weight: np.ndarray, top: int, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(levels uint8 [out, in'] in [0, top], scale and minimum float32 [out, in' / 32], each a float16 value)
    with weight ~= scale * level + minimum block by block of 32 inputs (in' = in rounded up to 32, padded
    with zeros). The minimum is rounded down and the scale up to float16, so that every weight lies within
    [minimum, minimum + top scale] and is off by at most scale / 2."""
    rows, cols = weight.shape
    padded = np.zeros((rows, -(-cols // 32) * 32), dtype=np.float32)
    padded[:, :cols] = weight
    blocks = padded.reshape(rows, -1, 32)
    minimum = _float16_toward(_per_block(np.minimum, blocks), -np.inf)
    scale = _float16_toward((_per_block(np.maximum, blocks) - minimum) / np.float32(top), np.inf)
    if not (np.isfinite(minimum).all() and np.isfinite(scale).all()):
        raise ValueError(f"{name}: a weight block is beyond float16's range")
    inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    levels = blocks - minimum[:, :, None]
    levels *= inverse[:, :, None]
    np.rint(levels, out=levels)
    np.clip(levels, 0, top, out=levels)
    return levels.astype(np.uint8).reshape(rows, -1), scale, minimum


def _blocks_of(file_blocks: dict[str, Blocks], *names: str) -> Blocks | None:
    """The file's blocks of these weights stacked by rows (as the model stacks q, k and v), when it
    holds them all in one kind of block (fdcore.checkpoint.ggml_blocks); taken from ``file_blocks``."""
    return concatenate_rows([file_blocks.pop(name, None) for name in names])


def _nbytes(matrix) -> int:
    """The bytes a pass over a packed matrix reads."""
    if isinstance(matrix, F32Matrix):
        return matrix.array.nbytes
    tensors = [matrix.packed] + ([matrix.scales] if isinstance(matrix, Int8Matrix) else [])
    return sum(int(t.numel()) * t.element_size() for t in tensors)


def _per_block(ufunc, blocks: np.ndarray) -> np.ndarray:
    """``ufunc`` reduced over the last axis of a contiguous ``[rows, blocks, 32]`` (reduceat: twice as
    fast as ``.max(axis=2)`` on rows this short, which matters for loading a model)."""
    flat = blocks.reshape(-1)
    return ufunc.reduceat(flat, np.arange(0, flat.size, blocks.shape[2])).reshape(blocks.shape[:2])


def _float16_toward(values: np.ndarray, direction: float) -> np.ndarray:
    """``values`` (float32) rounded to float16 and moved one step toward ``direction`` where that rounding
    went the other way; returned widened to float32."""
    rounded = values.astype(np.float16)
    wrong = rounded > values if direction < 0 else rounded < values
    rounded[wrong] = np.nextafter(rounded[wrong], np.float16(direction))
    return rounded.astype(np.float32)


def linear(x: paddle.Tensor, weight, bias: paddle.Tensor | None = None) -> paddle.Tensor:
    """``x @ weight.T (+ bias)`` for a weight stored ``[out, in]``: a plain tensor through Paddle's (MKL's)
    matmul, the packed kinds through fdcore's kernels (Paddle's CPU build has no bfloat16 matmul, and
    its float32 one is slower than F32Matrix's kernel at every batch size measured: F32Matrix). A gated
    Bf16Matrix's product comes out in its packed order (16 gate and 16 up outputs by turns): the same
    product, which is what a GEMM floor times; the model takes its SwiGLU (swiglu)."""
    if isinstance(weight, F32Matrix):
        out = _F32_LINEAR[0](x, weight.packed, weight.rows)
    elif isinstance(weight, Bf16Matrix):
        out = _BF16_LINEAR[0](x, weight.packed, weight.rows)
    elif isinstance(weight, Int8Matrix):
        out = _INT8_LINEAR[0](x, weight.packed, weight.scales, weight.rows)
    elif isinstance(weight, Int4Matrix):
        out = _INT4_LINEAR[0](x, weight.packed, weight.rows)
    else:
        out = paddle.matmul(x, weight, transpose_y=True)
    return out if bias is None else out + bias


def swiglu(x: paddle.Tensor, gate_up, bias: paddle.Tensor | None, silu_mul) -> paddle.Tensor:
    """The MLP's activations silu(gate) * up of x's gate and up products ([rows, I]): a gated Bf16Matrix's in its
    product's epilogue (Bf16Matrix.pack_gated), any other's product then ``silu_mul`` ([rows, 2 I] -> [rows, I])."""
    if isinstance(gate_up, Bf16Matrix) and gate_up.gated:
        if bias is None:
            if _NO_BIAS[0] is None:  # (one empty tensor for every call: each made its own, ~2 us a layer)
                _NO_BIAS[0] = paddle.empty([0], dtype="float32")
            bias = _NO_BIAS[0]
        return _BF16_SWIGLU[0](x, gate_up.packed, bias, gate_up.rows)
    return silu_mul(linear(x, gate_up, bias))


def _silu_mul(gate_up: paddle.Tensor) -> paddle.Tensor:
    """SwiGLU of a [rows, 2 I] product with Paddle's ops (the Python path's)."""
    gate, up = paddle.split(gate_up, 2, axis=-1)
    return paddle.nn.functional.silu(gate) * up


_F32_LINEAR: list = [None]  # the compiled kernels, loaded by the first model that needs them
_BF16_LINEAR: list = [None]
_BF16_SWIGLU: list = [None]
_NO_BIAS: list = [None]  # the empty bias tensor swiglu() hands the gated kernel for a bias-less MLP
_INT8_LINEAR: list = [None]
_INT4_LINEAR: list = [None]
_PACKED = {"bfloat16": Bf16Matrix, "wint8": Int8Matrix, "wint4": Int4Matrix}  # a matrix kind's packed form
# which files' blocks (fdcore.checkpoint.ggml_blocks.Blocks.kind) a matrix kind takes level for level: wint8's 256
# levels hold a 4-bit block's 16 with its scale and minimum, so a Q4_1 file run as wint8 multiplies the file's
# weights, where quantizing them again moved SmolLM2's logits enough to change a greedy token (bench_quality)
_HOLDS_BLOCKS = {"wint8": ("wint8", "wint4"), "wint4": ("wint4",)}
_KIND_CODES = {matrix: DECODER_KINDS.index(kind) for matrix, kind in
               ((F32Matrix, "float32"), (Bf16Matrix, "bfloat16"), (Int8Matrix, "int8"), (Int4Matrix, "int4"))}
_PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's matrices

# a packed matrix's arrays, as a shared weight file stores them (LlamaModel._weights_manifest)
_PARTS = {F32Matrix: lambda m: [m.array], Bf16Matrix: lambda m: [m.packed], Int8Matrix: lambda m: [m.packed, m.scales],
          Int4Matrix: lambda m: [m.packed]}


class StoredMatrix(msgspec.Struct, tag="m", array_like=True):
    """A packed matrix in a shared weight file: its class's name, its arrays (_PARTS), rows, gated."""

    kind: str
    parts: list[Stored]
    rows: int
    gated: bool = False


class WeightsManifest(msgspec.Struct):
    """Where a model's weights lie in a shared weight file (fdcore.models.shared_weights): the model's
    attributes of the same names; a layer's entries as its dict holds them (an int: its window)."""

    model: str  # what the weights were packed for (LlamaModel._packed_for): a process of another refuses them
    tied: bool  # the embedding and the LM head are one matrix
    embed: Stored | StoredMatrix
    embed_rows: Stored | None
    lm_head: Stored | StoredMatrix
    norm: Stored
    layers: list[dict[str, Stored | StoredMatrix | int | None]]


def _stored(shared: WeightFile, value):
    """``value`` (an array or tensor packed into ``shared``; an int or None as it is) as the manifest holds it."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, np.ndarray):
        return shared.stored(value)
    if value.dtype == paddle.bfloat16:
        return shared.stored(np.from_dlpack(value.view(paddle.int16)), tensor=True, dtype="bfloat16")
    return shared.stored(np.from_dlpack(value), tensor=True)


def _matrix_kind(dtype: str, quantization: str) -> str:
    """How the projections' weights are kept: float32; bfloat16 where the CPU multiplies it natively
    (AVX512-BF16); wint8 or wint4 where it has AVX512-VNNI or AVX2 (with either dtype: the weights are int8 or
    4-bit then). The kernel must have been built."""
    from fdcore.models.kernels import linear_bf16, linear_bf16_swiglu, linear_int4, linear_int8, missing_cpu_feature

    if quantization not in ("none", "wint8", "wint4"):
        raise ValueError(f"quantization {quantization!r}: none, wint8 or wint4")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {dtype!r}: the CPU model computes in float32 or bfloat16")
    kind = dtype if quantization == "none" else quantization
    if kind == "float32":
        return kind
    table, build = {"bfloat16": (_BF16_LINEAR, linear_bf16), "wint8": (_INT8_LINEAR, linear_int8),
                    "wint4": (_INT4_LINEAR, linear_int4)}[kind]
    missing = missing_cpu_feature(kind)
    if missing:
        raise ValueError(f"{kind} needs a CPU with {missing}; this one has none")
    table[0] = build()
    if kind == "wint4":
        _INT8_LINEAR[0] = linear_int8()  # for the LM head (see LlamaModel.__init__); the same library
    if kind == "bfloat16":
        _BF16_SWIGLU[0] = linear_bf16_swiglu()  # (gated gate_up: swiglu)
    if table[0] is None:
        raise ValueError(f"{kind} needs fdcore's C++ operators, which could not be built here")
    return kind


PAGE_COST_FLOOR = 16 << 20  # (bytes a decode pass streams below which page size is not measured)


def shared_pages_slowdown(args: ModelArgs, fd: int | None = None, budget: int = 256 << 20) -> float | None:
    """How much slower a batch-1 decode step's products stream their weights from the shared file ``fd``'s
    pages than from private huge pages here (fdcore.models.shared_weights.shared_pages_cost): one float32
    matrix of the model's hidden width, as many bytes as its layers stream up to ``budget``, one row through
    it in one call. One call, not the layers' shapes: a decode step reads its weights as one long stream,
    and a probe of many small calls measured Python's dispatch beside the memory (7-16 % on a Zen 4 EPYC
    whose decode step ran 50 % slower on 4 KiB pages; one 256 MiB call: 41-43 %, run after run). None
    without the float32 kernel, and None for a model whose layers stream fewer than ``PAGE_COST_FLOOR``
    bytes: they stay in the caches and the TLB's reach, where the page size costs nothing and a
    measurement would read only the machine's noise."""
    if not _f32_kernel():
        return None
    h, d, inner = args.hidden_size, args.head_dim, args.intermediate_size
    shapes = [((args.num_heads + 2 * args.num_kv_heads) * d, h), (h, args.num_heads * d), (2 * inner, h), (h, inner)]
    streamed = args.num_layers * sum(-(-rows // 32) * 32 * cols * 4 for rows, cols in shapes)
    if streamed < PAGE_COST_FLOOR:
        return None
    panels = min(streamed, budget) // (h * 32 * 4)
    row = paddle.ones([1, h], dtype=paddle.float32)

    def one_pass(array: np.ndarray) -> None:
        linear(row, F32Matrix(array[:panels * h * 32].reshape(panels, h, 32), panels * 32))

    return shared_pages_cost(one_pass, panels * h * 32 * 4, fd)


def _f32_kernel() -> bool:
    """Whether float32 weights go to fdcore's kernel (as F32Matrix): on CPUs with AVX-512F or AVX2, when it was
    built (loaded here). Otherwise they stay plain tensors for MKL's matmul; float32 is never refused."""
    from fdcore.models.kernels import linear_f32

    op = linear_f32()
    if op is not None:
        _F32_LINEAR[0] = op
    return op is not None


def _weight32(array: np.ndarray) -> np.ndarray:
    """A weight's float32 values as the model keeps them: the checkpoint's array itself where it is float32
    already (no second copy while the model is built), copied into the shared weight file when the model
    is packed into one."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    return on_huge_pages(array) if packing_shared() else array


def _rms_norm_np(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """HF's RMSNorm over the last axis of a numpy array (hidden states, Qwen3's per-head q / k)."""
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(variance + np.float32(eps))) * weight


def _rms_norm(x: paddle.Tensor, weight: np.ndarray, eps: float) -> paddle.Tensor:
    """HF's RMSNorm, in numpy (five tiny Paddle ops cost ~10x more than the arithmetic)."""
    return as_paddle(_rms_norm_np(x.numpy(), weight, eps))


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """HF's rotate-half rotary embedding: x * cos + rotate_half(x) * sin (a new array)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
