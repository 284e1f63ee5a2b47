"""Structured outputs: every constrained output parses and validates, across crashes too.

The tiny model's weights are random, so it draws whatever the grammar allows: a harder test of the
constraint than a trained model, which mostly writes valid JSON on its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import jsonschema
import numpy as np
import pytest

from fdcore import AsyncLLM, SamplingParams, StructuredOutputs
from fdcore.checkpoint import tiny
from fdcore.core.structured import Grammars, grammar_of
from fdcore.core.token_mask import allowed_tokens, pack_allowed
from fdcore.core.tokenizer import load_tokenizer
from fdcore.core.validation import RequestError
from fdcore.models.sampling import SamplerRequest, sample
from tests.tree.test_crash_resume import actor_pid, config, stream_all

pytestmark = [pytest.mark.tree, pytest.mark.kernels]

SCHEMAS = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(str(tmp_path_factory.mktemp("structured") / "tiny"))


@pytest.fixture(scope="module")
def grammars(model_dir):
    return Grammars(load_tokenizer(model_dir), tiny.CONFIG["vocab_size"], (tiny.CONFIG["eos_token_id"],))


# ------------------------------------------------------------------ schemas
def random_schema(rng: np.random.Generator) -> dict:
    """An object schema with nested objects, arrays, enums, ranged numbers, bounded strings,
    required and optional fields and (one time in three) a $ref into $defs."""
    defs = {}
    schema = _object(rng, 0, defs)
    if defs:
        schema["$defs"] = defs
    return schema


def _object(rng, depth: int, defs: dict) -> dict:
    names = [f"{'abcdefgh'[i]}{depth}" for i in range(int(rng.integers(1, 5)))]
    properties = {name: _value(rng, depth + 1, defs) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _value(rng, depth: int, defs: dict) -> dict:
    kinds = ["integer", "number", "string", "enum", "boolean", "array", "null_or_string"]
    if depth < 3:
        kinds += ["object", "ref"]
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "integer":
        low = int(rng.integers(-1000, 1000))
        return {"type": "integer", "minimum": low, "maximum": low + int(rng.integers(0, 5000))}
    if kind == "number":
        return {"type": "number", "minimum": -50, "maximum": 50}
    if kind == "string":
        return {"type": "string", "minLength": int(rng.integers(0, 3)), "maxLength": int(rng.integers(3, 12))}
    if kind == "enum":
        return {"enum": ["red", "green", "blue", 7, None][: int(rng.integers(2, 6))]}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null_or_string":
        return {"type": ["null", "string"], "maxLength": 6}
    if kind == "array":
        items = _value(rng, depth + 1, defs) if depth < 3 else {"type": "integer", "minimum": 0, "maximum": 9}
        low = int(rng.integers(0, 2))
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + int(rng.integers(1, 4))}
    if kind == "object":
        return _object(rng, depth, defs)
    name = f"shared{len(defs)}"
    defs[name] = {}  # the name taken before the definition's own refs pick theirs (no recursion)
    defs[name] = _object(rng, depth, defs) if rng.random() < 0.5 else {"enum": ["on", "off"]}
    return {"$ref": f"#/$defs/{name}"}


def constrained(i: int, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=400, structured_outputs=StructuredOutputs(**spec))


# ------------------------------------------------------------------ pure parts
@pytest.mark.parametrize(
    "spec, field, says",
    [
        ({}, "structured_outputs", "give one of"),
        ({"regex": "a+", "choice": ["a"]}, "structured_outputs.choice", "only one of"),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json", "JSON schema object"),
        ({"choice": []}, "structured_outputs.choice", "non-empty list"),
        ({"choice": ["a", ""]}, "structured_outputs.choice[1]", "non-empty string"),
        ({"regex": ""}, "structured_outputs.regex", "non-empty string"),
    ],
)
def test_a_constraint_not_given_right_names_its_field(spec, field, says):
    with pytest.raises(RequestError) as caught:
        grammar_of(StructuredOutputs(**spec))
    assert caught.value.field == field and says in str(caught.value)


@pytest.mark.parametrize(
    "spec, field, says",
    [
        ({"regex": "a(b"}, "structured_outputs.regex", "unclosed group"),
        (
            {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
            "structured_outputs.json",
            "missing",
        ),
        ({"grammar": "start: foo\n"}, "structured_outputs.grammar", "foo"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_with_what_is_wrong(grammars, spec, field, says):
    with pytest.raises(RequestError) as caught:
        grammars.check(StructuredOutputs(**spec))
    assert caught.value.field == field and says in str(caught.value) and "cannot be compiled" in str(caught.value)


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"regex": r"[^\s\S]"}, "structured_outputs.regex"),
        ({"json": {"$ref": "#"}}, "structured_outputs.json"),
        ({"grammar": 'start: "a" start'}, "structured_outputs.grammar"),
        ({"grammar": 'start: x\nx: "a" x | y\ny: y "b"'}, "structured_outputs.grammar"),
        ({"grammar": 'root ::= "a" root'}, "structured_outputs.grammar"),
        ({"grammar": "start: /[^\\s\\S]/"}, "structured_outputs.grammar"),
    ],
)
def test_a_constraint_whose_language_is_empty_is_refused(grammars, spec, field):
    """Nothing but the end of text would be allowed (or text that never ends): a 400 saying so, never an
    answer outside the language."""
    with pytest.raises(RequestError) as caught:
        grammars.check(StructuredOutputs(**spec))
    assert caught.value.field == field and "admits no output" in str(caught.value) and caught.value.code == 400


@pytest.mark.parametrize(
    "grammar",
    [
        'start: "a" start | "b"',
        'start: [start] "a"',
        'start: x*\nx: x "a"',
        'start: sum\nsum: atom | sum "+" atom\natom: /[0-9]+/',
        'start: ""',
    ],
)
def test_recursive_grammars_with_a_way_out_are_served(grammars, grammar):
    assert grammars.check(StructuredOutputs(grammar=grammar)).llguidance


def test_every_form_compiles_to_one_llguidance_grammar(grammars):
    gbnf = 'root ::= "a" [0-9]+'
    for spec in (
        {"json": {"type": "object"}},
        {"json_object": True},
        {"regex": "[a-z]+"},
        {"choice": ["x", "y"]},
        {"grammar": "start: /[0-9]+/"},
        {"grammar": gbnf},
    ):
        checked = grammars.check(StructuredOutputs(**spec))
        assert checked == StructuredOutputs(llguidance=checked.llguidance) and checked.llguidance
        assert grammars.check(checked) == checked  # what the workers get is itself a valid request


def test_the_mask_is_what_the_matcher_allows_and_a_replayed_matcher_is_where_it_was(grammars):
    grammar = grammars.check(StructuredOutputs(choice=["yes", "no"])).llguidance
    fresh = grammars.matcher(grammar, [])
    first = np.flatnonzero(allowed_tokens(grammars.allowed([fresh])[0], grammars.vocab_size))
    words = {grammars.tokenizer.decode_str([t]) for t in first}
    assert words and all("yes".startswith(w) or "no".startswith(w) for w in words)
    yes = grammars.tokenizer.tokenize_str("yes")
    replayed = grammars.matcher(grammar, yes)
    assert list(np.flatnonzero(allowed_tokens(grammars.allowed([replayed])[0], grammars.vocab_size))) == [
        tiny.CONFIG["eos_token_id"]
    ]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=4, repetition_penalty=1.3, logprobs=2),
    ],
)
def test_the_sampler_draws_only_allowed_tokens_and_reports_the_models_logprobs(params):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(32, 512)).astype(np.float32)
    allowed = np.zeros((32, 512), dtype=bool)
    for row in range(32):
        allowed[row, rng.choice(512, size=3, replace=False)] = True
    requests = [SamplerRequest(params, [1, 2], [3], allowed=pack_allowed(allowed[i])) for i in range(32)]
    picks = sample(logits, requests)
    assert all(allowed[i, pick.token_id] for i, pick in enumerate(picks))
    if params.logprobs:
        shifted = logits[0] - logits[0].max()
        expected = shifted - np.log(np.exp(shifted).sum())
        assert picks[0].logprob == pytest.approx(float(expected[picks[0].token_id]), abs=1e-5)


def test_the_gumbel_kernel_reads_the_packed_mask_as_the_numpy_path_does(monkeypatch):
    """A plain temperature batch, half of it constrained (a vocabulary not a multiple of 32): the
    kernel, reading the packed bits itself, draws what the numpy fallback draws from masked logits."""
    import fdcore.models.sampling as sampling

    rng = np.random.default_rng(5)
    logits = rng.normal(size=(16, 4099)).astype(np.float32)
    allowed = rng.random((16, 4099)) < 0.01
    requests = [
        SamplerRequest(
            SamplingParams(temperature=0.9, seed=i), [1], [2], allowed=pack_allowed(allowed[i]) if i % 2 else None
        )
        for i in range(16)
    ]
    kernel = [p.token_id for p in sample(logits, requests)]
    monkeypatch.setattr(sampling, "_gumbel_kernel", lambda: None)
    assert kernel == [p.token_id for p in sample(logits, requests)]
    assert all(allowed[i, t] for i, t in enumerate(kernel) if i % 2)


def test_min_tokens_gives_way_to_a_grammar_that_is_complete():
    logits = np.zeros((1, 16), dtype=np.float32)
    allowed = np.zeros(16, dtype=bool)
    allowed[2] = True  # only EOS: the grammar is satisfied
    pick = sample(
        logits,
        [
            SamplerRequest(
                SamplingParams(temperature=1.0, seed=1, min_tokens=5),
                [1],
                [],
                eos_token_ids=(2,),
                allowed=pack_allowed(allowed),
            )
        ],
    )
    assert pick[0].token_id == 2


# ------------------------------------------------------------------ served
def _served(model_dir, prompts, params, scenario=None):
    """Stream every request (concurrently) through a tree: once clean and, with ``scenario``, once
    more with it killing actors; returns both runs' (tokens, text, finish, error, code)."""

    async def main():
        async with AsyncLLM(config(model_dir)) as client:
            clean = await stream_all(client, prompts, params)
            if scenario is None:
                return clean, None
            state = {"done": False}

            async def progress(total):
                if not state["done"]:
                    state["done"] = scenario(client, total)

            crashed = await stream_all(client, prompts, params, progress)
            assert state["done"], "the scenario did not run"
            return clean, crashed

    return asyncio.run(main())


def test_200_random_json_schemas_all_parse_and_validate(model_dir):
    rng = np.random.default_rng(2026)
    schemas = [random_schema(rng) for _ in range(SCHEMAS)]
    prompts = [[5 + (i * 131 + j * 17) % 4000 for j in range(8)] for i in range(SCHEMAS)]
    params = [constrained(i, json=schema) for i, schema in enumerate(schemas)]
    outputs, _ = _served(model_dir, prompts, params)
    for i, (schema, (_, text, finish, error, _)) in enumerate(zip(schemas, outputs, strict=True)):
        assert error == "" and finish == "stop", f"schema {i}: {finish} {error} {text!r}"
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_grammar_and_json_object(model_dir):
    specs = [
        {"regex": r"[A-Z][a-z]{2,6} (19|20)[0-9]{2}"},
        {"choice": ["alpha", "beta", "gamma delta"]},
        {"grammar": 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'},
        {"json_object": True},
    ] * 4
    prompts = [[7 + i, 11, 13 + i] for i in range(len(specs))]
    outputs, _ = _served(model_dir, prompts, [constrained(i, **spec) for i, spec in enumerate(specs)])
    for spec, (_, text, finish, error, _) in zip(specs, outputs, strict=True):
        assert error == "" and finish == "stop", (spec, text, error)
        if "regex" in spec:
            assert re.fullmatch(spec["regex"], text), text
        elif "choice" in spec:
            assert text in spec["choice"]
        elif "grammar" in spec:
            assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text), text
        else:
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("kind", ["worker", "engine"])
def test_a_crash_mid_generation_changes_no_constrained_token(model_dir, kind):
    """Seeded and greedy constrained streams: the same tokens after a SIGKILL (the new worker replays
    each sequence's tokens through a new matcher; a new engine recompiles the re-submitted ones)."""
    rng = np.random.default_rng(7)
    schemas = [random_schema(rng) for _ in range(12)]
    prompts = [[9 + (i * 37 + j * 5) % 4000 for j in range(10)] for i in range(12)]
    params = [
        constrained(i, json=schema)
        if i % 3
        else SamplingParams(temperature=0.0, max_tokens=400, structured_outputs=StructuredOutputs(json=schema))
        for i, schema in enumerate(schemas)
    ]

    def kill_once(client, total):
        if total < 150:
            return False
        os.kill(actor_pid(client, kind), signal.SIGKILL)
        return True

    clean, crashed = _served(model_dir, prompts, params, kill_once)
    for i, (want, got) in enumerate(zip(clean, crashed, strict=True)):
        assert got[3] == "" and got[:3] == want[:3], f"request {i} changed after the {kind} was killed"
        if got[2] == "stop":  # (greedy on random weights may write a number's digits until max_tokens)
            jsonschema.validate(json.loads(got[1]), schemas[i])
    assert sum(got[2] == "stop" for got in crashed) >= 8
