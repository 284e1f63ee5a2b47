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

# isort: split
import paddle

from fdcore.checkpoint import Checkpoint
from fdcore.checkpoint.ggml_blocks import Blocks
from fdcore.core.batch import BatchInput
from fdcore.models.kernels import DECODER_META, DECODER_SLOTS
from fdcore.models.kv_cache import PagedKVCache
from fdcore.models.matrices import (
    HOLDS_BLOCKS,
    KIND_CODES,
    PACKED,
    PROJECTIONS,
    Bf16Matrix,
    F32Matrix,
    Int4Matrix,
    Int8Matrix,
    blocks_of,
    f32_kernel,
    linear,
    matrix_kind,
    matrix_nbytes,
    swiglu,
    weight32,
)
from fdcore.models.reference import PythonLayers, rms_norm
from fdcore.models.shared_weights import Stored, WeightFile
from fdcore.models.step_plan import StepPlan
from fdcore.models.tensor_parallel import GATHER_ROWS, TensorGroup
from fdcore.models.tensors import StepInputs, as_paddle, packing_weights
from fdcore.models.weights_manifest import PARTS, StoredMatrix, WeightsManifest, stored_value


class LlamaModel(PythonLayers):
    """The weights (as Paddle tensors) and the forward pass.

    Projections are packed for fdcore's kernels (F32Matrix, Bf16Matrix, Int8Matrix,
    Int4Matrix; see ``linear``). Where float32 has no kernel (neither AVX-512F nor AVX2) they keep
    Hugging Face's ``[out, in]`` layout and are applied with
    ``matmul(x, w, transpose_y=True)``: with MKL that is 1.4-1.7x faster than
    the same product on an ``[in, out]`` copy (0.61 vs 0.86 ms, 1.8 vs 3.1 ms
    for the 4096-wide head at batch 64).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        dtype: str = "float32",
        quantization: str = "none",
        group: TensorGroup | None = None,
        shared: WeightFile | None = None,
    ):
        """``group``: this rank's place in a tensor-parallel worker group (its shard of a checkpoint cut by
        fdcore.models.tensor_parallel, and the group's communicator); None: the whole model here.
        ``shared``: the rank's weight file (fdcore.models.shared_weights): attached, the weights are mapped
        from it (``checkpoint.tensors`` unused); else they are packed into it and published there, as far
        as it has room (``shared.full`` says where it had none)."""
        self.args = args = checkpoint.args
        self.group = group
        self.dtype = paddle.float32
        self.matrix_dtype = matrix_kind(dtype, quantization)  # projections: float32, bfloat16, wint8, wint4
        self.f32_kernel = self.matrix_dtype == "float32" and f32_kernel()  # float32 as F32Matrix
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
        self.scale = args.head_dim**-0.5
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
        streamed_bytes = sum(matrix_nbytes(m) for m in matrices)  # (a pass's bytes: SmolLM2 float32's 538 MB, 3 rounds)
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
            self.embed_rows = weight32(embed)  # (what _embed_rows gathers from: the tensor's memory)
            self.embed = as_paddle(self.embed_rows)
            head_name = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
            self.lm_head = self._matrix(
                embed if args.tie_word_embeddings else t.pop(head_name), head_kind, blocks_of(file_blocks, head_name)
            )
        del embed
        self.norm = weight32(t.pop("model.norm.weight"))
        self.layers = [self._layer(t, file_blocks, i) for i in range(args.num_layers)]

    def _decoder_plan(self):
        """``(op, weights, meta, kind)`` for the one-call decoder (kernels/decoder.cc: every layer of a step
        in one operator, the same kernels in the same order, so the same bits as ``_fused_layers``'s
        per-layer calls, without their ~8 dispatches a layer); None when it is not built or the layers'
        projections are not all of one packed kind (float32 left to MKL on CPUs without AVX2)."""
        from fdcore.models.kernels import decoder_layers

        op = decoder_layers()
        kinds = {type(layer[name]) for layer in self.layers for name in PROJECTIONS}
        if op is None or len(kinds) != 1 or next(iter(kinds)) not in KIND_CODES:
            return None
        if kinds == {Bf16Matrix} and not all(layer["gate_up"].gated for layer in self.layers):
            raise RuntimeError("decoder_layers takes a bfloat16 model's gate_up gated (Bf16Matrix.pack_gated)")
        weights, meta = [], []
        for layer in self.layers:
            weights += [self._slot_tensor(layer, slot) for slot in DECODER_SLOTS]
            meta += [layer[name].rows for name in DECODER_META[:-1]] + [layer["window"]]
        return op, weights, meta, KIND_CODES[kinds.pop()], self._decoder_head()

    def _slot_tensor(self, layer: dict, slot: str) -> paddle.Tensor:
        """A layer's tensor for the one-call decoder's slot ``slot`` (DECODER_SLOTS); an empty one where it has none."""
        name, _, part = slot.rpartition("_") if slot.endswith(("_scales", "_bias")) else (slot, "", "")
        if name in PROJECTIONS:
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
        if self.group is not None or type(head) not in KIND_CODES:
            return None
        none = self.no_tensor
        return [head.packed, getattr(head, "scales", none), none], KIND_CODES[type(head)], head.rows

    def _weights_manifest(self, shared: WeightFile) -> WeightsManifest:
        """Where each of the weights lies in ``shared``, into which they were packed (see _map_weights)."""

        def entry(value):
            parts = PARTS.get(type(value))
            if parts is None:
                return stored_value(shared, value)
            return StoredMatrix(
                type(value).__name__,
                [stored_value(shared, part) for part in parts(value)],
                value.rows,
                getattr(value, "gated", False),
            )

        tied = self.embed is self.lm_head
        return WeightsManifest(
            self._packed_for(),
            tied,
            entry(self.embed),
            None if self.embed_rows is None or tied else stored_value(shared, self.embed_rows),
            entry(self.lm_head),
            stored_value(shared, self.norm),
            [{name: entry(value) for name, value in layer.items()} for layer in self.layers],
        )

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
        its levels (the file's exact weights, not the float32 array quantized again: see HOLDS_BLOCKS)."""
        kind = kind or self.matrix_dtype
        if kind == "float32":
            return F32Matrix.pack(array) if self.f32_kernel else as_paddle(weight32(array))
        if blocks is not None and blocks.kind in HOLDS_BLOCKS.get(kind, ()):
            return PACKED[kind].from_blocks(blocks)
        return PACKED[kind].pack(array)

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
        return np.concatenate(
            [
                self.group.comm.gather(linear(states[first : first + GATHER_ROWS], self.lm_head).numpy())
                for first in range(0, max(states.shape[0], 1), GATHER_ROWS)
            ]
        )

    def _row_parallel(self, x: paddle.Tensor, matrix, bias) -> paddle.Tensor:
        """An output projection (o, down): in a group, each rank's partial product, summed."""
        y = linear(x, matrix, bias)
        return y if self.group is None else as_paddle(self.group.comm.all_reduce(y.numpy()))

    def _layer(self, t: dict, file_blocks: dict[str, Blocks], i: int) -> dict:
        p = f"model.layers.{i}."
        take = lambda name: t.pop(p + name)
        a = self.args

        def stacked(*names: str):  # weights multiplied as one: stacked by rows
            arrays = [take(name) for name in names]
            array = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            return self._matrix(array, blocks=blocks_of(file_blocks, *(p + name for name in names)))

        def gate_up():  # bfloat16: gated, SwiGLU in the product's epilogue (Bf16Matrix.pack_gated)
            names = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
            if self.matrix_dtype != "bfloat16":
                return stacked(*names)
            blocks_of(file_blocks, *(p + name for name in names))  # (taken: bfloat16 holds no file's blocks)
            return Bf16Matrix.pack_gated(*(take(name) for name in names))

        layer = {
            "qkv": stacked(*(f"self_attn.{n}_proj.weight" for n in "qkv")),
            "o": stacked("self_attn.o_proj.weight"),
            "gate_up": gate_up(),
            "down": stacked("mlp.down_proj.weight"),
            "in_norm": weight32(take("input_layernorm.weight")),
            "post_norm": weight32(take("post_attention_layernorm.weight")),
            "window": a.window(i),
        }
        if a.qkv_bias:
            layer["qkv_bias"] = as_paddle(weight32(np.concatenate([take(f"self_attn.{n}_proj.bias") for n in "qkv"])))
        if a.o_bias:
            layer["o_bias"] = as_paddle(weight32(take("self_attn.o_proj.bias")))
        if a.mlp_bias:
            layer["gate_up_bias"] = as_paddle(
                weight32(np.concatenate([take("mlp.gate_proj.bias"), take("mlp.up_proj.bias")]))
            )
            layer["down_bias"] = as_paddle(weight32(take("mlp.down_proj.bias")))
        if a.qk_norm:
            layer["q_norm"] = weight32(take("self_attn.q_norm.weight"))
            layer["k_norm"] = weight32(take("self_attn.k_norm.weight"))
            layer["q_norm_t"], layer["k_norm_t"] = as_paddle(layer["q_norm"]), as_paddle(layer["k_norm"])
        return layer

    # ------------------------------------------------------------------ forward
    @paddle.no_grad()
    def forward(self, batch: BatchInput, cache: PagedKVCache) -> np.ndarray:
        """Logits of each sequence's last new token, [num_seqs, vocab] float32, caller's order."""
        return self.forward_rows(batch, cache, ())[0]

    def forward_rows(
        self, batch: BatchInput, cache: PagedKVCache, every_row_of: tuple[int, ...]
    ) -> tuple[np.ndarray, dict[int, paddle.Tensor]]:
        """:meth:`forward`'s logits, and for each sequence (index into ``batch``) in ``every_row_of``
        the final hidden state of every new token, [tokens, hidden] (prompt scoring turns them
        into logits a slice at a time with :meth:`logits`: a long prompt's logits at once would
        be tokens x vocab floats)."""
        order = sorted(range(batch.num_seqs), key=lambda s: len(batch.token_ids[s]) != 1)
        plan = StepPlan(batch, order, cache, masks=self.fused is None, windows=self.windows)
        hidden = self._embed(plan.token_ids)
        cos, sin = self.args.rope.tables(
            plan.positions, plan.rope_lengths(batch, order) if self.args.rope.is_dynamic else None
        )
        rows = {s: plan.rows_of(order.index(s)) for s in every_row_of}
        if self.fused is not None:
            normed, logits = self._fused_layers(hidden, cos, sin, plan, cache)
            logits = (
                self._head(paddle.index_select(normed, as_paddle(plan.last_rows))) if logits is None else logits.numpy()
            )
            states = {s: normed[first:end] for s, (first, end) in rows.items()}
        else:
            hidden = as_paddle(hidden)
            for index, layer in enumerate(self.layers):
                hidden = self._layer_forward(hidden, layer, index, cos, sin, plan, cache)
            last = paddle.index_select(hidden, paddle.to_tensor(plan.last_rows))
            logits = self._head(rms_norm(last, self.norm, self.args.rms_norm_eps))
            states = {
                s: rms_norm(hidden[first:end], self.norm, self.args.rms_norm_eps) for s, (first, end) in rows.items()
            }
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
            return op(
                *inputs,
                *cache.all_tensors(),
                weights,
                self.norm_t,
                meta,
                kind,
                a.num_heads,
                self.scale,
                eps,
                self.decoder_group,
                head,
            )
        hidden, cos_t, sin_t, slots = as_paddle(hidden), as_paddle(cos), as_paddle(sin), as_paddle(plan.write_slots)
        tables, lengths = (as_paddle(array) for array in plan.row_arrays())
        delta, none = self.no_tensor, self.no_tensor
        for index, layer in enumerate(self.layers):
            hidden, x = add_rms_norm(hidden, delta, layer["in_norm_t"], eps)
            qkv = linear(x, layer["qkv"], layer.get("qkv_bias"))
            k, v = cache.tensors(index)
            attn = attention_block(
                qkv,
                cos_t,
                sin_t,
                slots,
                k,
                v,
                tables,
                lengths,
                layer.get("q_norm_t", none),
                layer.get("k_norm_t", none),
                a.num_heads,
                self.scale,
                layer["window"],
                eps,
            )
            hidden, x = add_rms_norm(
                hidden, self._row_parallel(attn, layer["o"], layer.get("o_bias")), layer["post_norm_t"], eps
            )
            activations = swiglu(x, layer["gate_up"], layer.get("gate_up_bias"), silu_mul)
            delta = self._row_parallel(activations, layer["down"], layer.get("down_bias"))
        return add_rms_norm(hidden, delta, self.norm_t, eps)[1], None
