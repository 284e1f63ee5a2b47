"""Scheduler + cache manager + model + sampler in one process, against the reference outputs."""

from __future__ import annotations

import json
import os

import pytest

from fdcore.checkpoint import load_checkpoint, tiny
from fdcore.core.kv_cache_manager import KVCacheManager
from fdcore.core.scheduler import BatchLimits, Request, Scheduler, Status
from fdcore.models.engine_core import EngineCore
from fdcore.models.kv_cache import PagedKVCache
from fdcore.models.llama import LlamaModel
from fdcore.protocol import SamplingParams
from tests import DATA

pytestmark = pytest.mark.kernels

REFERENCE = json.load(open(os.path.join(DATA, "reference.json")))
CASES = REFERENCE["checkpoints"]["llama-gqa"]["cases"]
GREEDY = SamplingParams(temperature=0, max_tokens=REFERENCE["new_tokens"], ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny.make_tiny_model(str(tmp_path_factory.mktemp("m") / "tiny"))
    return LlamaModel(load_checkpoint(path, progress=lambda *_: None))


def make_core(model, num_blocks=256, budget=512, max_seqs=16, prefix=True) -> EngineCore:
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=prefix)
    scheduler = Scheduler(BatchLimits(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=2048), kv)
    return EngineCore(model, PagedKVCache(model.args, num_blocks, BLOCK), scheduler)


def run(core: EngineCore, prompts: dict[str, list[int]], params=GREEDY) -> dict[str, Request]:
    requests = {rid: Request(rid, ids, params) for rid, ids in prompts.items()}
    for request in requests.values():
        core.add(request)
    core.run()
    return requests


def test_concurrent_requests_with_chunked_prefill_equal_the_reference(model):
    core = make_core(model, budget=256)  # the long prompt takes several steps
    done = run(core, {case: spec["prompt"] for case, spec in CASES.items()})
    for case, request in done.items():
        assert request.output_token_ids == CASES[case]["output"], case
        assert request.finish_reason == "length"
    assert core.scheduler.kv.num_free_blocks == 256


def test_preemption_under_a_tiny_kv_budget_gives_identical_outputs(model):
    prompts = {f"r{i}": CASES["non_ascii"]["prompt"][i:] + CASES["short"]["prompt"] for i in range(6)}
    roomy = run(make_core(model), prompts)
    tight_core = make_core(model, num_blocks=6, budget=64)
    tight = run(tight_core, prompts)
    assert sum(r.num_preemptions for r in tight.values()) > 0, "the budget should force preemption"
    assert {k: r.output_token_ids for k, r in tight.items()} == {k: r.output_token_ids for k, r in roomy.items()}


def test_prefix_caching_hits_and_changes_nothing(model):
    shared = CASES["long"]["prompt"][:300]
    prompts = {f"p{i}": shared + [100 + i, 200 + i] for i in range(4)}
    cached_core = make_core(model, max_seqs=1)  # one at a time, so later ones find the prefix
    with_cache = run(cached_core, prompts)
    without = run(make_core(model, max_seqs=1, prefix=False), prompts)
    assert cached_core.scheduler.kv.statistics().hit_rate > 0.5
    assert {k: r.output_token_ids for k, r in with_cache.items()} == {k: r.output_token_ids for k, r in without.items()}


def test_abort_frees_blocks_at_once_and_others_carry_on(model):
    core = make_core(model)
    a = Request("a", CASES["long"]["prompt"], GREEDY)
    b = Request("b", CASES["short"]["prompt"], GREEDY)
    core.add(a)
    core.add(b)
    core.step()
    held = 256 - core.scheduler.kv.num_free_blocks
    assert core.scheduler.abort("a") is a and a.finish_reason == "abort"
    assert 256 - core.scheduler.kv.num_free_blocks < held
    core.run()
    assert a.status is Status.FINISHED and b.output_token_ids == CASES["short"]["output"]


def test_stop_tokens_min_tokens_and_max_tokens(model):
    expected = CASES["short"]["output"]
    stop_at = expected[5]
    core = make_core(model)
    done = run(
        core, {"s": CASES["short"]["prompt"]}, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at])
    )
    first = expected.index(stop_at)
    assert done["s"].output_token_ids == expected[: first + 1] and done["s"].finish_reason == "stop"
    done = run(make_core(model), {"m": CASES["short"]["prompt"]}, SamplingParams(temperature=0, max_tokens=3))
    assert done["m"].output_token_ids == expected[:3] and done["m"].finish_reason == "length"
