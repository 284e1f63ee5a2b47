"""Tenants through the actor tree: a client (or a peer of the HTTP server) that fills the KV cache with
long requests does not keep another's request waiting for them to end."""

from __future__ import annotations

import asyncio

import pytest

from fdcore import AsyncLLM, SamplingParams
from fdcore.checkpoint import tiny
from tests.supervised import tree_config

pytestmark = pytest.mark.tree


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("tenants") / "tiny"))


@pytest.mark.parametrize("fair", [True, False])
def test_a_light_request_is_served_while_two_tenants_hold_the_cache(model_dir, fair):
    """Two tenants each send six 100-token prompts for 200 tokens (far more than the 4 sequences and
    1,024 tokens of cache the tree runs at once); a third sends one short request once they run and some
    wait. With tenants it finishes while every long one is still running; as one tenant (first come,
    first served) it waits behind them."""
    config = tree_config(
        model_dir,
        cache={"num_blocks": 64, "enable_prefix_caching": False},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 256},
    )
    long = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)

    async def main():
        async with AsyncLLM(config) as llm:
            finished: list[str] = []

            async def run(name: str, prompt: list[int], params: SamplingParams, tenant: str):
                async for out in llm.generate(prompt, params, tenant=tenant if fair else ""):
                    if out.finished:
                        assert out.outputs.finish_reason == "length", out.error_msg
                        finished.append(name)

            greedy = [
                asyncio.ensure_future(run(f"{t}{i}", [5 + i + 10 * j % 3000 for j in range(100)], long, t))
                for t in ("a", "b")
                for i in range(6)
            ]
            while (await llm.stats()).waiting < 4:  # the long ones hold the cache, and some wait for room
                await asyncio.sleep(0.01)
            await run("light", [7, 8, 9, 10], SamplingParams(max_tokens=4, temperature=0), "c")
            done_first = list(finished)
            await asyncio.gather(*greedy)
            return done_first, finished

    done_first, finished = asyncio.run(main())
    assert len(finished) == 13
    if fair:
        assert done_first == ["light"], "the light request waited for a long one to end"
    else:
        assert done_first[-1] == "light" and len(done_first) > 1
