"""Stop conditions through the whole actor tree: EOS, min_tokens, stop_token_ids, stop strings.

The model is the bundled tiny one with its generation_config.json's EOS set to
the sixth token its greedy continuation of a prompt produces, so EOS really
happens mid-generation (a random model would otherwise almost never say it).
Async scheduling keeps a second step in flight: a request that stops must not
get that step's token.
"""

from __future__ import annotations

import json
import os

import pytest

from fdcore import LLM, SamplingParams
from fdcore.checkpoint import tiny
from fdcore.config import parse_config
from tests import DATA

pytestmark = pytest.mark.tree

REFERENCE = json.load(open(os.path.join(DATA, "reference.json")))
CASE = REFERENCE["checkpoints"]["llama-gqa"]["cases"]["short"]  # the bundled tiny model's greedy tokens
PROMPT, GREEDY_TOKENS = CASE["prompt"], CASE["output"]
EOS_AT = 5
EOS = GREEDY_TOKENS[EOS_AT]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    assert EOS not in GREEDY_TOKENS[:EOS_AT]
    path = tiny.make_tiny_model(str(tmp_path_factory.mktemp("stops") / "tiny"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": EOS}, f)
    engine = LLM(parse_config(f'[model]\npath = "{path}"\n[workers]\nstandby = false\n'))
    yield engine
    engine.shutdown()


def _one(llm, **params):
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, **params), use_tqdm=False)[0]
    assert out.error_code == 0, out.error_msg
    return out.outputs


def test_eos_ends_the_request_and_the_step_in_flight_adds_nothing(llm):
    out = _one(llm, max_tokens=20)
    assert out.finish_reason == "stop"
    assert out.token_ids == GREEDY_TOKENS[: EOS_AT + 1]  # the EOS token is the last one, nothing after it


def test_ignore_eos_runs_to_max_tokens(llm):
    out = _one(llm, max_tokens=20, ignore_eos=True)
    assert out.finish_reason == "length" and out.token_ids == GREEDY_TOKENS[:20]


def test_min_tokens_holds_eos_back(llm):
    out = _one(llm, max_tokens=20, min_tokens=10)
    assert out.token_ids[:EOS_AT] == GREEDY_TOKENS[:EOS_AT]
    assert EOS not in out.token_ids[:10]
    assert len(out.token_ids) >= 10


def test_a_stop_token_id_ends_the_request(llm):
    stop_at = 8
    out = _one(llm, max_tokens=20, ignore_eos=True, stop_token_ids=[GREEDY_TOKENS[stop_at]])
    first = GREEDY_TOKENS.index(GREEDY_TOKENS[stop_at])
    assert out.finish_reason == "stop"
    assert out.token_ids == GREEDY_TOKENS[: first + 1]


def test_a_stop_string_cuts_the_text_before_it(llm):
    full = _one(llm, max_tokens=24, ignore_eos=True).text
    start = len(full) // 2
    stop = full[start : start + 3]
    cut = full.index(stop)
    out = _one(llm, max_tokens=24, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == full[:cut]
    assert len(out.token_ids) < 24
