"""The serving path through the whole actor tree: outputs, many clients, prefix caching,
preemption, aborts and bad requests (each test against real processes)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from fdcore import LLM, AsyncLLM, SamplingParams
from fdcore.checkpoint import load_checkpoint, tiny
from fdcore.core.kv_cache_manager import KVCacheManager
from fdcore.core.scheduler import BatchLimits, Request, Scheduler
from fdcore.models.engine_core import EngineCore
from fdcore.models.kv_cache import PagedKVCache
from fdcore.models.llama import LlamaModel
from tests import ROOT
from tests.supervised import tree_config

pytestmark = [pytest.mark.tree, pytest.mark.kernels]

REFERENCE = json.load(open(os.path.join(ROOT, "tests", "data", "reference.json")))
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("serving") / "tiny"))


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(tree_config(model_dir))
    yield engine
    engine.shutdown()


def in_process(model_dir: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """The same requests through EngineCore in this process: the reference for the tree."""
    checkpoint = load_checkpoint(model_dir, progress=lambda *_: None)
    core = EngineCore(
        LlamaModel(checkpoint),
        PagedKVCache(checkpoint.args, 1024, 16),
        Scheduler(BatchLimits(), KVCacheManager(1024, 16)),
    )
    requests = [
        Request(f"r{i}", p, sp, checkpoint.eos_token_ids) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    for request in requests:
        core.add(request)
    core.run()
    return [r.output_token_ids for r in requests]


def token_prompts(count: int, length: int, salt: int) -> list[list[int]]:
    return [[3 + (salt * 7919 + i * 104729 + j * 31) % 4000 for j in range(length + i % 5)] for i in range(count)]


# ------------------------------------------------------------------ outputs
def test_tree_greedy_outputs_equal_transformers(llm):
    cases = REFERENCE["checkpoints"]["llama-gqa"]["cases"]
    params = SamplingParams(max_tokens=REFERENCE["new_tokens"], **GREEDY)
    outs = llm.generate([{"prompt_token_ids": c["prompt"]} for c in cases.values()], params)
    for out, (name, case) in zip(outs, cases.items(), strict=True):
        assert out.outputs.token_ids == case["output"], name
        assert out.outputs.finish_reason == "length" and out.finished
        assert out.prompt_token_ids == case["prompt"]


def test_text_prompts_chat_and_metrics(llm, model_dir):
    outs = llm.generate(
        ["Grüße aus München", [{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=12, **GREEDY)
    )
    expected = in_process(model_dir, [o.prompt_token_ids for o in outs], [SamplingParams(max_tokens=12, **GREEDY)] * 2)
    assert [o.outputs.token_ids for o in outs] == expected
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    assert outs[0].outputs.text == tokenizer.decode(expected[0])
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # the tiny model's template
    assert outs[1].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False).ids
    m = outs[0].metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert (m.num_prompt_tokens, m.num_generated_tokens) == (len(outs[0].prompt_token_ids), 12)


def test_seeded_sampling_is_reproducible_through_the_tree(llm):
    prompts = token_prompts(6, 20, salt=5)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9 if i % 2 else 1.0, seed=100 + i, max_tokens=10, ignore_eos=True)
        for i in range(6)
    ]
    first = [o.outputs.token_ids for o in llm.generate(prompts, params)]
    again = [o.outputs.token_ids for o in llm.generate(prompts[::-1], params[::-1])][::-1]
    assert first == again


CLIENT = """
import json, sys
from fdcore import LLM, SamplingParams
llm = LLM.connect(sys.argv[1])
prompts = json.loads(sys.argv[2])
outs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6), use_tqdm=False)
print(json.dumps([o.outputs.token_ids for o in outs]))
llm.shutdown()
"""


def test_two_client_processes_with_256_concurrent_requests(llm, model_dir):
    prompts = {side: token_prompts(128, 12, salt=side) for side in (1, 2)}
    procs = {
        side: subprocess.Popen(
            [sys.executable, "-c", CLIENT, llm.instance, json.dumps(prompts[side])],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        for side in (1, 2)
    }
    try:
        results = {side: json.loads(proc.communicate(timeout=240)[0]) for side, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    params = SamplingParams(max_tokens=6, **GREEDY)
    expected = in_process(model_dir, prompts[1] + prompts[2], [params] * 256)
    assert results[1] + results[2] == expected


# --------------------------------------------------------------- streaming
def test_async_stream_deltas_add_up_and_abort_frees_blocks_at_once(llm, model_dir):
    async def scenario():
        async with AsyncLLM.connect(llm.instance) as client:
            pieces, tokens = [], []
            async for out in client.generate("def main():", SamplingParams(max_tokens=20, **GREEDY)):
                pieces.append(out.outputs.text)
                tokens += out.outputs.token_ids
            assert out.finished and out.outputs.finish_reason == "length"
            whole = llm.generate("def main():", SamplingParams(max_tokens=20, **GREEDY))[0]
            assert "".join(pieces) == whole.outputs.text and tokens == whole.outputs.token_ids

            seen = []
            stream = client.generate([5] * 300, SamplingParams(max_tokens=600, **GREEDY), request_id="long")
            async for out in stream:
                seen.append(out)
                if len(seen) == 3:
                    busy = await client.stats()
                    await client.abort("long")
            assert seen[-1].outputs.finish_reason == "abort" and seen[-1].finished
            idle = await client.stats()
            return busy, idle

    busy, idle = asyncio.run(scenario())
    assert busy.running == 1 and busy.cache.num_free < busy.cache.num_blocks
    assert idle.running == 0 and idle.waiting == 0
    assert idle.cache.num_free == idle.cache.num_blocks, "the aborted request's blocks are free"


# ---------------------------------------------------------- prefix caching
def test_prefix_caching_hits_and_gives_the_outputs_of_caching_off(llm, model_dir):
    shared = token_prompts(1, 160, salt=9)[0][:160]
    prompts = [shared + [100 + i, 200 + i, 300 + i] for i in range(6)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    before = llm.stats().cache
    llm.generate(prompts[:1], params)  # computes (and caches) the shared prefix
    cached = [o.outputs.token_ids for o in llm.generate(prompts, params)]
    after = llm.stats().cache
    hit = after.hit_tokens - before.hit_tokens
    assert hit >= 6 * 160 - 16, f"only {hit} prompt tokens came from the prefix cache"
    assert after.hit_rate > 0
    with LLM(tree_config(model_dir, cache={"enable_prefix_caching": False})) as plain:
        uncached = [o.outputs.token_ids for o in plain.generate(prompts, params)]
        assert plain.stats().cache.hit_tokens == 0
    assert cached == uncached


# --------------------------------------------------------------- preemption
def test_preemption_under_a_tiny_kv_budget_gives_identical_outputs(llm, model_dir):
    prompts = token_prompts(6, 40, salt=3)
    params = [
        SamplingParams(max_tokens=40, **GREEDY)
        if i % 2
        else SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True)
        for i in range(6)
    ]
    roomy = [o.outputs.token_ids for o in llm.generate(prompts, params)]
    with LLM(tree_config(model_dir, cache={"num_blocks": 12})) as tight:
        squeezed = [o.outputs.token_ids for o in tight.generate(prompts, params)]
        stats = tight.stats()
    assert stats.preemptions > 0, "the budget was meant to force preemption"
    assert squeezed == roomy


# ------------------------------------------------------------- bad requests
BAD_REQUESTS = [
    ("", {}, "prompt"),
    ({"prompt_token_ids": []}, {}, "prompt_token_ids"),
    ({"prompt_token_ids": [5000]}, {}, "prompt_token_ids[0]"),
    ({"prompt_token_ids": [-1]}, {}, "prompt_token_ids[0]"),
    ({"messages": []}, {}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, {}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, {}, "messages[0].content"),
    ({"prompt": "x", "bogus": 1}, {}, "bogus"),
    ({"prompt": "x", "prompt_token_ids": [5]}, {}, "prompt_token_ids"),
    ({"prompt_token_ids": [5] * 2100}, {}, "prompt"),
    ({"prompt_token_ids": [5] * 2000}, {"min_tokens": 100, "max_tokens": 200}, "min_tokens"),
    ("x", {"temperature": -1.0}, "temperature"),
    ("x", {"temperature": "hot"}, "temperature"),
    ("x", {"top_p": 0.0}, "top_p"),
    ("x", {"top_k": -2}, "top_k"),
    ("x", {"min_p": 2.0}, "min_p"),
    ("x", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("x", {"presence_penalty": 3.0}, "presence_penalty"),
    ("x", {"frequency_penalty": -3.0}, "frequency_penalty"),
    ("x", {"max_tokens": 0}, "max_tokens"),
    ("x", {"max_tokens": 1.5}, "max_tokens"),
    ("x", {"n": 2}, "n"),
    ("x", {"seed": -1}, "seed"),
    ("x", {"logprobs": 21}, "logprobs"),
    ("x", {"stop": [""]}, "stop[0]"),
    ("x", {"stop": "x"}, "stop"),
    ("x", {"stop_token_ids": [99999]}, "stop_token_ids[0]"),
]


def test_bad_requests_get_clear_errors_and_everyone_else_is_served(llm):
    async def scenario():
        async with AsyncLLM.connect(llm.instance) as client:

            async def last(prompt, params, request_id=None):
                tokens = []
                async for out in client.generate(prompt, params, request_id):
                    tokens += out.outputs.token_ids
                out.outputs.token_ids = tokens
                return out

            good = asyncio.create_task(last("def main():", SamplingParams(max_tokens=30, **GREEDY)))
            bad = [last(prompt, SamplingParams(**params)) for prompt, params, _ in BAD_REQUESTS]
            bad.append(last("x", SamplingParams(), request_id="r" * 300))
            return await asyncio.gather(*bad), await good

    bad, good = asyncio.run(scenario())
    fields = [field for _, _, field in BAD_REQUESTS] + ["request_id"]
    for out, field in zip(bad, fields, strict=True):
        assert out.finished and out.outputs.finish_reason == "error", field
        assert out.error_code == 400, (field, out.error_msg)
        assert out.error_msg.startswith(f"{field}:"), (field, out.error_msg)
    assert good.outputs.finish_reason == "length" and len(good.outputs.token_ids) == 30
    assert llm.check_health() == (True, "")


DYING_CLIENT = """
import sys
from fdcore import LLM, SamplingParams
llm = LLM.connect(sys.argv[1])
llm._conn.submit("doomed", [5] * 40, SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True))
print("submitted", flush=True)
sys.stdin.read()  # until killed
"""


def test_a_client_that_dies_has_its_requests_aborted(llm):
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", DYING_CLIENT, llm.instance],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "submitted"
        deadline = time.monotonic() + 30
        while llm.stats().running < 1:  # the request is running on the engine's side
            assert time.monotonic() < deadline, "the dying client's request never started"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 1.0  # README: "its requests are aborted within a second"
        while (stats := llm.stats()).running or stats.cache.num_free < stats.cache.num_blocks:
            assert time.monotonic() < deadline, f"the dead client's request still runs after 1 s: {stats}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
