"""Tensor-parallel ranks (issue 17): the split of heads, MLP columns and vocabulary, and two or three
rank processes summing through the shared-memory communicator giving TP=1's greedy tokens and, within
float rounding, its logits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import posix_ipc
import pytest

from fdcore.checkpoint import CheckpointError, load_checkpoint, tiny
from fdcore.ipc import names
from fdcore.ipc.allreduce import ShmCommunicator
from fdcore.ipc.shm import unlink_quietly
from fdcore.models.tensor_parallel import head_shares, shard_checkpoint, share

pytestmark = [pytest.mark.tree, pytest.mark.kernels]

CAPACITY = 8 << 20
STEPS = 12

# One rank: its shard of the checkpoint, a model on it, and a run of continuous batching in
# miniature (3 prompts; prefill in chunks, then greedy decode), saving the tokens and last logits.
RANK = textwrap.dedent("""
    import sys
    import numpy as np
    from fdcore.core.batch import BatchInput
    from fdcore.ipc.allreduce import ShmCommunicator
    from fdcore.models.kv_cache import PagedKVCache
    from fdcore.models.llama import LlamaModel
    from fdcore.checkpoint import load_checkpoint
    from fdcore.models.tensor_parallel import PaddleCommunicator, TensorGroup, shard_checkpoint

    path, quantization, name, rank, world, capacity, steps, out = sys.argv[1:9]
    rank, world, steps = int(rank), int(world), int(steps)
    checkpoint = load_checkpoint(path, progress=lambda *_: None)
    group = None
    if world > 1:
        checkpoint, shard = shard_checkpoint(checkpoint, rank, world)
        comm = (PaddleCommunicator(rank, world, name.removeprefix("paddle:")) if name.startswith("paddle:")
                else ShmCommunicator.attach(name, rank, world, int(capacity), timeout=60))
        group = TensorGroup(shard, comm)
    model = LlamaModel(checkpoint, "float32", quantization, group)
    if sys.argv[9:] == ["per-layer"]:
        model.decoder = None  # the layers one by one, summed by the communicator's Python all_reduce
    cache = PagedKVCache(checkpoint.args, 24, 16)
    prompts = [[5 + (i * 37 + j * 11) % 4000 for j in range(20 + 9 * i)] for i in range(3)]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    done, outputs, last = [0, 0, 0], [[], [], []], []
    while any(len(o) < steps for o in outputs):
        batch = BatchInput([], [], [], [])
        members = []
        for i, prompt in enumerate(prompts):
            seq = prompt + outputs[i]
            if len(outputs[i]) >= steps:
                continue
            ids = seq[done[i]:done[i] + 16]
            batch.token_ids.append(ids); batch.start_positions.append(done[i])
            batch.block_tables.append(tables[i]); batch.prompt_lengths.append(len(prompt))
            members.append(i)
        logits = model.forward(batch, cache)
        for row, i in enumerate(members):
            done[i] += len(batch.token_ids[row])
            if done[i] == len(prompts[i]) + len(outputs[i]):
                outputs[i].append(int(np.argmax(logits[row])))
        last = logits
    np.savez(out, tokens=np.array(outputs), logits=last)
""")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {
        "llama-gqa": tiny.make_tiny_model(str(root / "llama")),
        "qwen2-bias-tied": tiny.make_tiny_model(str(root / "qwen2"), arch="qwen2"),
        "llama-sharded": tiny.make_tiny_model(str(root / "sharded"), shards=3),
    }


def run_group(
    path: str, world: int, tmp_path, quantization: str = "none", comm: str = "shm", per_layer: bool = False
) -> list[dict]:
    if comm == "paddle":
        from fdcore.models.tensor_parallel import free_port_block

        name = f"paddle:127.0.0.1:{free_port_block(world + 1)}"
    else:
        name = names.object_name(names.new_instance_id(), "tp")
        ShmCommunicator.create(name, world, CAPACITY).close()
    outs = [tmp_path / f"rank{world}-{rank}.npz" for rank in range(world)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK,
                path,
                quantization,
                name,
                str(rank),
                str(world),
                str(CAPACITY),
                str(STEPS),
                str(out),
                *(["per-layer"] if per_layer else []),
            ],
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        )
        for rank, out in enumerate(outs)
    ]
    try:
        errors = [proc.communicate(timeout=300)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if comm == "shm":
            unlink_quietly(posix_ipc.unlink_shared_memory, name)
    for proc, err in zip(procs, errors, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return [dict(np.load(out)) for out in outs]


# ------------------------------------------------------------------- split
def test_shares_cover_everything_once():
    for total in (1, 7, 1536, 49152):
        for world in (1, 2, 3, 4):
            parts = [share(total, rank, world) for rank in range(world)]
            assert [i for part in parts for i in part] == list(range(total))


@pytest.mark.parametrize(
    "heads, kv, world, want",
    [
        (4, 2, 2, [(range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]),
        (9, 3, 2, [(range(0, 3), range(0, 1)), (range(3, 9), range(1, 3))]),  # SmolLM2: 1 and 2 KV groups
        (
            8,
            2,
            4,
            [
                (range(0, 2), range(0, 1)),
                (range(2, 4), range(0, 1)),
                (range(4, 6), range(1, 2)),
                (range(6, 8), range(1, 2)),
            ],
        ),  # fewer KV heads than ranks: each copied to 2 ranks
        (8, 8, 3, [(range(0, 2), range(0, 2)), (range(2, 5), range(2, 5)), (range(5, 8), range(5, 8))]),
    ],
)
def test_heads_are_split_at_kv_group_boundaries(heads, kv, world, want):
    assert head_shares(heads, kv, world) == want


def test_a_split_that_cannot_keep_kv_groups_whole_is_refused():
    with pytest.raises(CheckpointError, match="tensor_parallel_size 4: 6 query heads in 2 KV groups"):
        head_shares(6, 2, 4)


def test_each_rank_holds_its_slices(checkpoints):
    whole = load_checkpoint(checkpoints["qwen2-bias-tied"], progress=lambda *_: None)
    tensors = dict(whole.tensors)
    part, shard = shard_checkpoint(load_checkpoint(checkpoints["qwen2-bias-tied"], progress=lambda *_: None), 1, 2)
    d = whole.args.head_dim
    assert (part.args.num_heads, part.args.num_kv_heads) == (len(shard.heads), len(shard.kv_heads)) == (2, 1)
    q = "model.layers.0.self_attn.q_proj"
    np.testing.assert_array_equal(part.tensors[q + ".weight"], tensors[q + ".weight"][2 * d : 4 * d])
    np.testing.assert_array_equal(part.tensors[q + ".bias"], tensors[q + ".bias"][2 * d : 4 * d])
    o = "model.layers.0.self_attn.o_proj.weight"
    np.testing.assert_array_equal(part.tensors[o], tensors[o][:, 2 * d : 4 * d])
    down = "model.layers.0.mlp.down_proj.weight"
    np.testing.assert_array_equal(
        part.tensors[down], tensors[down][:, shard.intermediate.start : shard.intermediate.stop]
    )
    embed = "model.embed_tokens.weight"
    np.testing.assert_array_equal(part.tensors[embed], tensors[embed][shard.vocab.start : shard.vocab.stop])
    assert part.args.vocab_size == whole.args.vocab_size


def test_a_quantized_files_levels_are_cut_as_its_weights_are(checkpoints):
    """A GGUF file's blocks (fdcore.checkpoint.ggml_blocks) go with each rank's slices; a share of the inputs
    that does not cut at a block boundary leaves that weight to be quantized again on the rank."""
    from fdcore.checkpoint.ggml_blocks import Blocks
    from fdcore.models.matrices import Int4Matrix

    checkpoint = load_checkpoint(checkpoints["qwen2-bias-tied"], progress=lambda *_: None)
    for name, array in list(checkpoint.tensors.items()):
        if array.ndim == 2:
            checkpoint.blocks[name] = blocks = Blocks("wint4", *Int4Matrix.quantize(array))
            checkpoint.tensors[name] = blocks.dequantized()
    part, shard = shard_checkpoint(checkpoint, 1, 2)
    d = part.args.head_dim
    for name, blocks in part.blocks.items():
        np.testing.assert_array_equal(blocks.dequantized(), part.tensors[name], err_msg=name)
    o_cut_at_a_block = (len(shard.heads) * d) % 32 == 0
    assert ("model.layers.0.self_attn.o_proj.weight" in part.blocks) == o_cut_at_a_block
    assert {"model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"} <= set(part.blocks)


# ------------------------------------------------------------------- ranks
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-tied", "llama-sharded"])  # reference.json's
def test_two_ranks_give_one_ranks_tokens(checkpoints, tmp_path, name):
    solo = run_group(checkpoints[name], 1, tmp_path)[0]
    ranks = run_group(checkpoints[name], 2, tmp_path)
    for rank in ranks:
        assert rank["tokens"].tolist() == solo["tokens"].tolist()
        np.testing.assert_allclose(rank["logits"], solo["logits"], atol=1e-4)
    np.testing.assert_array_equal(ranks[0]["logits"], ranks[1]["logits"])  # every rank: the same bits
    assert not np.array_equal(ranks[0]["logits"], solo["logits"])  # computed apart, summed: not TP=1's bits


def test_paddle_distributed_ranks_give_the_shared_memory_ranks_tokens(checkpoints, tmp_path):
    """The other communicator: paddle.distributed over gloo (what a group across machines uses), two
    processes on this one: the same tokens as the shared-memory group, and TP=1's."""
    path = checkpoints["llama-gqa"]
    shm = run_group(path, 2, tmp_path)
    gloo = run_group(path, 2, tmp_path, comm="paddle")
    solo = run_group(path, 1, tmp_path)[0]
    for rank in gloo:
        assert rank["tokens"].tolist() == shm[0]["tokens"].tolist() == solo["tokens"].tolist()
        np.testing.assert_allclose(rank["logits"], shm[0]["logits"], atol=1e-5)


def test_the_decoders_in_kernel_sums_are_the_python_all_reduces_bits(checkpoints, tmp_path):
    """The one-call decoder sums a rank's products in C++ by the communicator's protocol and order:
    the same logits, to the bit, as the layers run one by one through its Python all_reduce."""
    path = checkpoints["qwen2-bias-tied"]
    in_kernel, per_layer = run_group(path, 2, tmp_path), run_group(path, 2, tmp_path, per_layer=True)
    np.testing.assert_array_equal(in_kernel[0]["logits"], per_layer[0]["logits"])
    assert in_kernel[0]["tokens"].tolist() == per_layer[0]["tokens"].tolist()


def test_two_ranks_with_wint8_weights(checkpoints, tmp_path):
    """Each rank quantizes its own slices (per row and block of 32 inputs, as the whole matrix's
    would be: the blocks do not straddle a cut at a multiple of 32): the same greedy tokens."""
    path = checkpoints["llama-gqa"]
    solo = run_group(path, 1, tmp_path, "wint8")[0]
    ranks = run_group(path, 2, tmp_path, "wint8")
    assert all(rank["tokens"].tolist() == solo["tokens"].tolist() for rank in ranks)
    assert not np.array_equal(ranks[0]["logits"], solo["logits"])  # computed apart, summed: not TP=1's bits


def test_two_ranks_of_the_real_model_give_its_tokens(tmp_path):
    """SmolLM2-135M (9 heads in 3 KV groups: shares of 1 and 2 groups; 49,152-token vocabulary)."""
    from fdcore.checkpoint import fetch

    path = fetch.fetch_smollm2()
    solo = run_group(path, 1, tmp_path)[0]
    ranks = run_group(path, 2, tmp_path)
    for rank in ranks:
        assert rank["tokens"].tolist() == solo["tokens"].tolist()
        np.testing.assert_allclose(rank["logits"], solo["logits"], atol=2e-3)


# ------------------------------------------------------------------- the tree
def group_config(path: str, world: int, standby: bool = True, batched_tokens: int = 64, **workers):
    from tests.supervised import tree_config

    return tree_config(
        path,
        scheduler={"max_num_batched_tokens": batched_tokens},
        workers={"tensor_parallel_size": world, "standby": standby, **workers},
        supervisor={"max_restarts": 100, "period": 60.0},
    )


def test_a_group_serves_one_workers_tokens(checkpoints):
    from fdcore import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [5 + (i * 37 + j * 11) % 4000 for j in range(20 + 9 * i)]} for i in range(4)]
    params = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True),
    ]
    tokens = {}
    for world in (1, 2):
        with LLM(group_config(checkpoints["llama-gqa"], world, standby=False)) as llm:
            tokens[world] = [[o.outputs.token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in params]
    assert tokens[2] == tokens[1]  # greedy and seeded sampling alike


@pytest.mark.parametrize("rank", [1, 0])
def test_sigkill_of_a_rank_restarts_the_group_and_changes_no_token(checkpoints, rank):
    """SIGKILL of one rank mid-generation: the whole group is restarted (the other rank too: its
    share of the KV cache is no use alone), every stream completes with the tokens of a run without
    the crash, and afterwards each actor is one process."""
    import asyncio

    from fdcore import AsyncLLM
    from fdcore.actors import topology
    from fdcore.supervisor import actor_census, actor_pid
    from tests.tree.test_crash_resume import requests, stream_all

    config = group_config(checkpoints["llama-gqa"], 2)
    prompts, params = requests()

    async def main():
        async with AsyncLLM(config) as client:
            clean = await stream_all(client, prompts, params)
            supervisor = client._tree.proc.pid
            before = {cid: actor_pid(supervisor, cid) for cid in ("worker0", "worker1")}
            killed = []

            async def kill_once(total):
                if not killed and total >= 100:
                    killed.append(before[f"worker{rank}"])
                    __import__("os").kill(killed[0], __import__("signal").SIGKILL)

            crashed = await stream_all(client, prompts, params, kill_once)
            after = {cid: actor_pid(supervisor, cid) for cid in ("worker0", "worker1")}
            census = actor_census(supervisor, topology.child_ids(config))
            return clean, crashed, killed, before, after, census, await client.check_health()

    clean, crashed, killed, before, after, census, health = asyncio.run(main())
    assert killed, "the kill did not happen"
    assert all(after[cid] != before[cid] for cid in after), f"not the whole group was restarted: {before} -> {after}"
    assert census == "", census
    assert health == (True, "")
    for i, (want, got) in enumerate(zip(clean, crashed, strict=True)):
        assert got[3] == "", f"request {i} failed: {got[3]}"
        assert got[:3] == want[:3], f"request {i} differs after the crash"


def test_a_paddle_distributed_group_in_the_tree(checkpoints):
    """workers.communicator = "paddle": the tree's group sums through paddle.distributed (gloo)."""
    from fdcore import LLM, SamplingParams

    path = checkpoints["llama-gqa"]
    prompts = [{"prompt_token_ids": [5 + (i * 37 + j * 11) % 4000 for j in range(20 + 9 * i)]} for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(group_config(path, 2, standby=False, communicator="paddle")) as llm:
        gloo = [o.outputs.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(group_config(path, 1, standby=False)) as llm:
        solo = [o.outputs.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert gloo == solo


def test_a_paddle_group_with_spares_is_refused():
    from fdcore.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="workers.standby' is true with workers.communicator"):
        parse_config('[workers]\ntensor_parallel_size = 2\ncommunicator = "paddle"\n', check_model=False)


def test_a_group_scores_prompts_and_keeps_to_a_grammar_as_one_worker(checkpoints):
    """prompt_logprobs (every rank scores, through 16-token chunks) and a regex constraint (rank 0's
    masks) give TP=1's tokens and, within float rounding, its scores."""
    from fdcore import LLM, SamplingParams, StructuredOutputs

    prompt = {"prompt_token_ids": [3 + (j * 31) % 4000 for j in range(40)]}
    scored = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    held = SamplingParams(
        max_tokens=20, temperature=0.7, seed=3, structured_outputs=StructuredOutputs(regex="[a-z]{3,8}-[0-9]{2}")
    )
    runs = {}
    for world in (1, 2):
        config = group_config(checkpoints["llama-gqa"], world, standby=False, batched_tokens=16)
        with LLM(config) as llm:
            runs[world] = (
                llm.generate([prompt], scored, use_tqdm=False)[0],
                llm.generate(["hello"], held, use_tqdm=False)[0],
            )
    (solo_scores, solo_text), (group_scores, group_text) = runs[1], runs[2]
    assert group_scores.outputs.token_ids == solo_scores.outputs.token_ids
    for mine, theirs in zip(group_scores.prompt_logprobs[1:], solo_scores.prompt_logprobs[1:], strict=True):
        assert mine.token_id == theirs.token_id and abs(mine.logprob - theirs.logprob) < 1e-4
    assert group_text.outputs.text == solo_text.outputs.text
    assert __import__("re").fullmatch("[a-z]{3,8}-[0-9]{2}", group_text.outputs.text), group_text.outputs.text
