"""prompt_logprobs: every prompt token scored by the model given the tokens before it, equal to
scoring each prefix alone, through chunked prefill, the prefix cache and actor crashes."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from fdcore import LLM, AsyncLLM, SamplingParams
from fdcore.checkpoint import load_checkpoint, tiny
from fdcore.core.batch import BatchInput
from fdcore.models.kv_cache import PagedKVCache
from fdcore.models.llama import LlamaModel
from fdcore.models.sampling import score_tokens
from fdcore.supervisor import actor_pid
from tests.supervised import tree_config

pytestmark = [pytest.mark.tree, pytest.mark.kernels]

TOP = 3


def config(model: str):
    return tree_config(model, supervisor={"max_restarts": 100}, scheduler={"max_num_batched_tokens": 16})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("scores") / "tiny"))


@pytest.fixture(scope="module")
def model(model_dir):
    return LlamaModel(load_checkpoint(model_dir, progress=lambda *_: None))


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [3 + (j * 31 + salt * 977) % 4000 for j in range(length)]


def reference_scores(model: LlamaModel, prompt: list[int]) -> list[tuple[float, int, list[int]]]:
    """(logprob, rank, top ids) of each prompt token after the first, each prefix run alone (the
    last-token logits of an ordinary forward: none of prompt scoring's code)."""
    cache = PagedKVCache(model.args, 8, 16)
    table = list(range(8))
    out = []
    for end in range(1, len(prompt)):
        logits = model.forward(BatchInput([prompt[:end]], [0], [table], [end]), cache)[0].astype(np.float64)
        logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        chosen = logprobs[prompt[end]]
        out.append((chosen, int((logprobs > chosen).sum()) + 1, list(np.argsort(-logprobs, kind="stable")[:TOP])))
    return out


def assert_scores_match(scores, reference) -> None:
    assert scores[0] is None
    assert len(scores) == len(reference) + 1
    for i, (score, (logprob, rank, top)) in enumerate(zip(scores[1:], reference, strict=True), 1):
        assert score.logprob == pytest.approx(logprob, abs=2e-4), f"prompt token {i}"
        assert abs(score.rank - rank) <= 1, f"prompt token {i}: rank {score.rank}, want {rank}"  # near-ties
        assert [t for t, _ in score.top][:1] == [int(top[0])], f"prompt token {i}: best token"
        assert len(score.top) == TOP


# --------------------------------------------------------------- pure parts
def test_score_tokens_gives_each_rows_logprob_rank_and_best_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)).astype(np.float32)
    logits[2, 7] = logits[2, 9] = 9.0  # a tie at the top: the lower id first
    following = [4, 0, 9, 49, 13]
    scores = score_tokens(logits, following, 4)
    for row, (score, token) in enumerate(zip(scores, following, strict=True)):
        exact = logits[row].astype(np.float64)
        logprobs = exact - exact.max() - np.log(np.exp(exact - exact.max()).sum())
        assert score.token_id == token
        assert score.logprob == pytest.approx(logprobs[token], abs=1e-5)
        assert score.rank == 1 + int((logprobs > logprobs[token]).sum())
        assert [t for t, _ in score.top] == sorted(range(50), key=lambda t: (-logits[row, t], t))[:4]
    assert [t for t, _ in scores[2].top[:2]] == [7, 9]
    assert scores[2].rank == 1  # token 9 ties token 7 for the top: no token is strictly likelier
    assert score_tokens(logits, following, 0)[0].top == []


def test_scoring_requests_compute_their_whole_prompt():
    from fdcore.core.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    kv.allocate("a", prompt, 100)
    kv.cache_computed("a", prompt, 10)
    assert kv.allocate("b", prompt, 100) == 8
    assert kv.allocate("c", prompt, 100, reuse_prefix=False) == 0


def test_forward_rows_gives_every_new_rows_state(model):
    """The hidden states forward_rows returns, through the LM head, are each position's logits."""
    prompt = prompt_of(40)
    cache = PagedKVCache(model.args, 8, 16)
    logits, states = model.forward_rows(BatchInput([[5], prompt], [0, 0], [[7], list(range(3))], [1, 40]), cache, (1,))
    rows = model.logits(states[1])
    assert rows.shape == (40, model.args.vocab_size)
    np.testing.assert_allclose(rows[-1], logits[1], atol=1e-5)
    for end in (1, 17, 33):
        alone = model.forward(BatchInput([prompt[:end]], [0], [list(range(3, 6))], [end]), cache)[0]
        np.testing.assert_allclose(rows[end - 1], alone, atol=2e-4)


# --------------------------------------------------------------- the tree
def test_prompt_logprobs_through_chunked_prefill_and_the_prefix_cache(model_dir, model):
    """A 40-token prompt in 16-token chunks: every token's score equals its prefix scored alone; the
    same prompt again (its blocks cached now) is scored again, identically; no scores unasked."""
    prompt = prompt_of(40)
    reference = reference_scores(model, prompt)
    llm = LLM(config(model_dir))
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP)
        first, again = (llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0] for _ in range(2))
        plain = llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False
        )[0]
    finally:
        llm.shutdown()
    assert_scores_match(first.prompt_logprobs, reference)
    assert again.prompt_logprobs == first.prompt_logprobs
    assert plain.prompt_logprobs is None
    assert first.outputs.token_ids == again.outputs.token_ids == plain.outputs.token_ids


def test_bad_prompt_logprobs_is_refused_naming_the_field(model_dir):
    llm = LLM(config(model_dir))
    try:
        for value in (-1, 21):
            out = llm.generate(
                [{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=1, prompt_logprobs=value), use_tqdm=False
            )[0]
            assert out.outputs.finish_reason == "error"
            assert out.error_msg.startswith("prompt_logprobs"), out.error_msg
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["worker", "engine"])
def test_prompt_logprobs_survive_a_crash_mid_prefill_and_come_once(model_dir, model, kind):
    """Killed while the prompts are being scored: each stream's first output still carries its whole
    prompt's scores, equal to a run without the crash, and no later output carries them again."""
    prompts = [prompt_of(120, salt) for salt in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    child = {"worker": "worker0", "engine": "engine"}[kind]

    async def scores_of(client):
        async def one(i):
            carried = []
            async for out in client.generate({"prompt_token_ids": prompts[i]}, params, request_id=f"s{i}"):
                carried.append(out.prompt_logprobs)
                last = out
            return carried, last.outputs.finish_reason

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    async def main():
        async with AsyncLLM(config(model_dir)) as client:
            clean = await scores_of(client)
            base = (await client.stats()).steps
            task = asyncio.ensure_future(scores_of(client))
            while (await client.stats()).steps < base + 6:  # some of the 30 prefill chunks in
                await asyncio.sleep(0.005)
            os.kill(actor_pid(client._tree.proc.pid, child), signal.SIGKILL)
            return clean, await task

    clean, crashed = asyncio.run(main())
    for (want, want_reason), (got, got_reason) in zip(clean, crashed, strict=True):
        assert want_reason == got_reason == "length"
        assert got[0] == want[0] and got[0] is not None
        assert all(scores is None for scores in got[1:]), "prompt scores sent twice"
    assert_scores_match(clean[0][0][0], reference_scores(model, prompts[0]))
