"""How a checkpoint is split over the ranks of a tensor-parallel worker group (issue 17).

Megatron's split, as vLLM and FastDeploy do it: each rank holds
- a contiguous share of the attention heads, cut at KV-group boundaries (its query heads, and the
  KV heads they read: no KV head is split, and a rank's heads share KV heads in equal groups, which
  is what the attention kernel runs); with fewer KV heads than ranks, each KV head is copied to
  ``world / kv_heads`` ranks, which split its query heads;
- a contiguous share of the MLP's intermediate columns (gate and up rows, down's columns);
- a contiguous share of the vocabulary (embedding rows, LM head rows).

The output projections (o, down) are row-parallel: each rank's product is a partial sum, and the
group adds them with an all-reduce (their biases are added by rank 0 alone). A token's embedding
is the row of the one rank that holds it (the others give zeros), summed the same way; the logits
are each rank's vocabulary slice, gathered. Shares may be unequal (SmolLM2's 3 KV groups over 2
ranks: 2 and 1): every split is ``n * r // world`` to ``n * (r + 1) // world``.

Pure functions of shapes and arrays: tested without processes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fdcore.checkpoint import Checkpoint, CheckpointError, ModelArgs

GATHER_ROWS = 32  # logits rows gathered at once (a slot holds GATHER_ROWS x the vocabulary share)


@dataclasses.dataclass(frozen=True)
class Shard:
    """What one rank holds: query heads, KV heads, intermediate columns and vocabulary rows."""

    rank: int
    world: int
    heads: range
    kv_heads: range
    intermediate: range
    vocab: range


def share(total: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous share of ``total`` items split over ``world`` ranks."""
    return range(total * rank // world, total * (rank + 1) // world)


def head_shares(num_heads: int, num_kv_heads: int, world: int) -> list[tuple[range, range]]:
    """(query heads, KV heads) of each rank."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        kv = [share(num_kv_heads, rank, world) for rank in range(world)]
        return [(range(k.start * group, k.stop * group), k) for k in kv]
    copies = world // num_kv_heads  # ranks holding each KV head
    if world % num_kv_heads or group % copies:
        raise CheckpointError(
            f"tensor_parallel_size {world}: {num_heads} query heads in {num_kv_heads} KV groups "
            f"cannot be split over {world} ranks (with fewer KV heads than ranks, each KV head's "
            f"{group} query heads must split evenly over the ranks that copy it)"
        )
    per = group // copies
    shares = []
    for rank in range(world):
        kv_head, part = divmod(rank, copies)
        first = kv_head * group + part * per
        shares.append((range(first, first + per), range(kv_head, kv_head + 1)))
    return shares


def shard_of(checkpoint: Checkpoint, rank: int, world: int) -> Shard:
    a = checkpoint.args
    if world > a.num_heads:
        raise CheckpointError(
            f"tensor_parallel_size {world}: more ranks than the model's {a.num_heads} attention heads"
        )
    heads, kv_heads = head_shares(a.num_heads, a.num_kv_heads, world)[rank]
    return Shard(
        rank, world, heads, kv_heads, share(a.intermediate_size, rank, world), share(a.vocab_size, rank, world)
    )


def shard_checkpoint(checkpoint: Checkpoint, rank: int, world: int) -> tuple[Checkpoint, Shard]:
    """This rank's part of the checkpoint: its tensors (sliced copies; the whole ones are dropped as
    they are cut, so loading peaks at one tensor more than the shard) and its architecture (its
    head, KV-head and intermediate counts; ``vocab_size`` stays the model's: the logits are
    gathered whole)."""
    shard = shard_of(checkpoint, rank, world)
    a, t = checkpoint.args, checkpoint.tensors
    d = a.head_dim
    rows = lambda heads: slice(heads.start * d, heads.stop * d)
    cut = {
        "q_proj": (0, rows(shard.heads)),
        "k_proj": (0, rows(shard.kv_heads)),
        "v_proj": (0, rows(shard.kv_heads)),
        "o_proj": (1, rows(shard.heads)),
        "gate_proj": (0, _slice(shard.intermediate)),
        "up_proj": (0, _slice(shard.intermediate)),
        "down_proj": (1, _slice(shard.intermediate)),
    }

    def part_of(name: str) -> tuple[int, slice] | None:
        """Which axis of a tensor is cut, and this rank's share of it; None: the rank holds it whole."""
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, _slice(shard.vocab)
        return cut.get(module)

    out = {}
    for name in list(t):
        array, part = t.pop(name), part_of(name)
        if part is not None:
            axis, rows_or_columns = part
            if name.endswith(".weight"):
                array = array[rows_or_columns] if axis == 0 else array[:, rows_or_columns]
            elif axis == 0:  # a column-parallel bias: this rank's outputs
                array = array[rows_or_columns]
            elif rank != 0:  # a row-parallel bias is added once, by rank 0
                array = np.zeros_like(array)
        out[name] = np.ascontiguousarray(array)
    blocks = {}
    for name, whole in checkpoint.blocks.items():  # a GGUF file's levels, cut alike (where whole blocks are)
        part = part_of(name)
        cut_blocks = (
            whole if part is None else (whole.take_rows(part[1]) if part[0] == 0 else whole.take_columns(part[1]))
        )
        if cut_blocks is not None:
            blocks[name] = cut_blocks
    args = dataclasses.replace(
        a, num_heads=len(shard.heads), num_kv_heads=len(shard.kv_heads), intermediate_size=len(shard.intermediate)
    )
    return dataclasses.replace(checkpoint, args=args, tensors=out, blocks=blocks), shard


def _slice(items: range) -> slice:
    return slice(items.start, items.stop)


def communicator_capacity(args: ModelArgs, scheduler, world: int) -> int:
    """Bytes of each rank's slot in the group's communicator: a step's hidden states (up to
    ``scheduler.max_num_batched_tokens`` rows), ``GATHER_ROWS`` rows of a vocabulary share's logits,
    or a step's drawn tokens, whichever is largest. The supervisor (which makes the segment) and
    every rank compute it from the same whole-model shapes and configuration."""
    hidden = scheduler.max_num_batched_tokens * args.hidden_size * 4
    logits = GATHER_ROWS * -(-args.vocab_size // world) * 4
    return max(hidden, logits, scheduler.max_num_seqs * 8)


class TensorGroup:
    """A rank's place in its group, as its model uses it: its shard, and the communicator (for
    example fdcore.ipc.allreduce.ShmCommunicator) the group sums and gathers through."""

    def __init__(self, shard: Shard, comm):
        self.shard, self.comm = shard, comm

    def decoder_args(self):
        """(segment tensor, rank, world, capacity, timeout) for the one-call decoder's in-kernel sums, when
        the communicator is the shared-memory one; None otherwise (the layers then run one by one)."""
        if not hasattr(self.comm, "segment"):
            return None
        from fdcore.models.tensors import as_paddle

        return (as_paddle(self.comm.segment()), self.comm.rank, self.comm.world, self.comm.capacity, self.comm.timeout)

    def embed(self, rows_of, token_ids: np.ndarray) -> np.ndarray:
        """The embeddings of ``token_ids`` [tokens, hidden]: each rank looks up the tokens of its
        vocabulary share (``rows_of(local ids)``, numpy) and gives zeros for the others'; the group
        sums them."""
        local = np.asarray(token_ids, dtype=np.int64) - self.shard.vocab.start
        held = (local >= 0) & (local < len(self.shard.vocab))
        rows = np.array(rows_of(np.where(held, local, 0)), dtype=np.float32)
        rows[~held] = 0.0
        return self.comm.all_reduce(rows)


def free_port_block(count: int) -> int:
    """A port p with p .. p + count - 1 free now on 127.0.0.1 (a paddle.distributed group's store
    and rank endpoints). NOTE: the one place besides the API's HTTP server where fdcore touches a
    socket: a paddle.distributed group, chosen for groups across machines, rendezvouses over TCP;
    fdcore's own actors never do."""
    import socket

    def free(port: int) -> bool:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count < 65535 and all(free(port) for port in range(base, base + count)):
            return base
    raise RuntimeError("no block of free ports on 127.0.0.1")


class PaddleCommunicator:
    """The group's collectives through ``paddle.distributed`` (gloo on CPU, NCCL on GPU): what a group
    spanning machines uses, where no segment can be shared (the shared-memory one is fdcore.ipc's
    ShmCommunicator; both give ``all_reduce``, ``gather`` and ``broadcast`` with the same meaning).

    Joined at the first collective, not at start: ``init_parallel_env`` waits for every rank, and the
    supervisor starts ranks one by one, each reporting ready before the next starts. ``master`` is
    the host:port of the group's rendezvous store (rank 0 serves it)."""

    def __init__(self, rank: int, world: int, master: str):
        self.rank, self.world, self.master = rank, world, master
        self._dist = None

    def _join(self):
        import os

        import paddle.distributed as dist

        host, port = self.master.rsplit(":", 1)
        endpoints = ",".join(f"{host}:{int(port) + 1 + rank}" for rank in range(self.world))
        os.environ.update(
            {
                "PADDLE_DISTRI_BACKEND": "gloo",
                "PADDLE_TRAINER_ID": str(self.rank),
                "PADDLE_TRAINERS_NUM": str(self.world),
                "PADDLE_MASTER": self.master,
                "PADDLE_TRAINER_ENDPOINTS": endpoints,
                "PADDLE_CURRENT_ENDPOINT": endpoints.split(",")[self.rank],
            }
        )
        dist.init_parallel_env()
        self._dist = dist
        return dist

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        import paddle

        dist = self._dist or self._join()
        tensor = paddle.to_tensor(np.ascontiguousarray(x, dtype=np.float32))
        dist.all_reduce(tensor)
        return tensor.numpy()

    def gather(self, x: np.ndarray) -> np.ndarray:
        """Every rank's ``x`` joined along the last axis (widths may differ: padded to the widest)."""
        import paddle

        dist = self._dist or self._join()
        widths = []
        dist.all_gather(widths, paddle.to_tensor([x.shape[-1]], dtype="int64"))
        widths = [int(w.numpy()[0]) for w in widths]
        padded = np.zeros(x.shape[:-1] + (max(widths),), dtype=x.dtype)
        padded[..., : x.shape[-1]] = x
        parts = []
        dist.all_gather(parts, paddle.to_tensor(padded))
        return np.concatenate([part.numpy()[..., :width] for part, width in zip(parts, widths, strict=True)], axis=-1)

    def aborted(self) -> bool:
        """Never: a paddle.distributed group has no abort word (a lost peer surfaces as the runtime's error)."""
        return False

    def broadcast(self, x: np.ndarray | None, patience: float | None = None, waiting=None) -> np.ndarray:
        """Rank 0's int64 ``x`` on every rank (its length sent first). ``patience`` and ``waiting`` are
        the shared-memory communicator's; gloo waits by its own timeout and ticks nothing."""
        import paddle

        dist = self._dist or self._join()
        count = paddle.to_tensor([0 if x is None else len(x)], dtype="int64")
        dist.broadcast(count, src=0)
        data = paddle.to_tensor(
            np.asarray(x, dtype=np.int64) if self.rank == 0 else np.zeros(int(count.numpy()[0]), dtype=np.int64)
        )
        dist.broadcast(data, src=0)
        return data.numpy()

    def close(self) -> None:
        pass
