"""A table of bad requests: each gets a clear error naming the field and the limit."""

from __future__ import annotations

import pytest

from fdcore.core.validation import (
    ModelLimits,
    RequestError,
    check_length,
    check_one_prompt,
    check_sampling,
    check_token_ids,
    validate_request_id,
)
from fdcore.protocol import SamplingParams

LIMITS = ModelLimits(vocab_size=4096, max_model_len=2048)


def sp(**kw) -> SamplingParams:
    return SamplingParams(**kw)


BAD_SAMPLING = [
    (dict(temperature=-0.5), "temperature", "must be >= 0.0"),
    (dict(temperature=float("nan")), "temperature", "finite number"),
    (dict(temperature=float("inf")), "temperature", "finite number"),
    (dict(top_p=0.0), "top_p", "must be > 0.0 and <= 1.0"),
    (dict(top_p=1.5), "top_p", "must be <= 1.0"),
    (dict(min_p=-0.1), "min_p", "must be >= 0.0"),
    (dict(min_p=2.0), "min_p", "must be <= 1.0"),
    (dict(top_k=-2), "top_k", "must be in [-1, 4096]"),
    (dict(top_k=5000), "top_k", "must be in [-1, 4096]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "must be > 0.0"),
    (dict(presence_penalty=3.0), "presence_penalty", "must be <= 2.0"),
    (dict(frequency_penalty=-2.5), "frequency_penalty", "must be >= -2.0"),
    (dict(max_tokens=0), "max_tokens", "must be in [1, 2048]"),
    (dict(max_tokens=10**6), "max_tokens", "must be in [1, 2048]"),
    (dict(min_tokens=-1), "min_tokens", "must be in [0, 16]"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens", "at most max_tokens (10)"),
    (dict(n=2), "n", "only n = 1 is supported"),
    (dict(seed=-1), "seed", "must be in [0, 9223372036854775807]"),
    (dict(logprobs=21), "logprobs", "must be in [0, 20]"),
    (dict(stop=[""]), "stop[0]", "non-empty string"),
    (dict(stop=["x"] * 17), "stop", "at most 16 allowed"),
    (dict(stop_token_ids=[4096]), "stop_token_ids[0]", "outside the vocabulary [0, 4096)"),
    (dict(logit_bias={4096: 1.0}), "logit_bias[4096]", "outside the vocabulary [0, 4096)"),
    (dict(logit_bias={5: 100.5}), "logit_bias[5]", "must be <= 100.0"),
    (dict(logit_bias={5: float("nan")}), "logit_bias[5]", "finite number"),
    (dict(logit_bias={t: 1.0 for t in range(301)}), "logit_bias", "301 tokens, at most 300 allowed"),
]


@pytest.mark.parametrize("params, field, message", BAD_SAMPLING)
def test_bad_sampling_parameters(params, field, message):
    with pytest.raises(RequestError) as info:
        check_sampling(sp(**params), LIMITS)
    assert info.value.field == field and message in str(info.value) and info.value.code == 400


BAD_PROMPTS = [
    (dict(prompt=None, prompt_token_ids=None, messages=None), "prompt", "one of prompt, prompt_token_ids or messages"),
    (dict(prompt="hi", prompt_token_ids=[1], messages=None), "prompt_token_ids", "give only one"),
    (dict(prompt="", prompt_token_ids=None, messages=None), "prompt", "non-empty string"),
    (dict(prompt=None, prompt_token_ids=[], messages=None), "prompt_token_ids", "must not be empty"),
    (dict(prompt=None, prompt_token_ids=None, messages=[]), "messages", "non-empty list"),
    (
        dict(prompt=None, prompt_token_ids=None, messages=[{"role": "robot", "content": "x"}]),
        "messages[0].role",
        "'robot' is not one of",
    ),
    (
        dict(prompt=None, prompt_token_ids=None, messages=[{"role": "user", "content": 5}]),
        "messages[0].content",
        "must be a string",
    ),
    (dict(prompt=None, prompt_token_ids=None, messages=["hello"]), "messages[0]", "'role' and 'content'"),
    (
        dict(prompt=None, prompt_token_ids=None, messages=[{"role": "user", "content": "x", "colour": 1}]),
        "messages[0].colour",
        "unknown key",
    ),
    (
        dict(prompt=None, prompt_token_ids=None, messages=[{"role": "user", "content": None}]),
        "messages[0].content",
        "must be a string",
    ),
    (
        dict(prompt=None, prompt_token_ids=None, messages=[{"role": "user", "content": [{"type": "image"}]}]),
        "messages[0].content",
        "list of {type: text, text} parts",
    ),
    (
        dict(prompt=None, prompt_token_ids=None, messages=[{"role": "assistant", "tool_calls": [{"id": "c"}]}]),
        "messages[0].tool_calls[0]",
        "function: {name, arguments}",
    ),
    (
        dict(prompt=None, prompt_token_ids=None, messages=[{"role": "tool", "content": "x", "tool_call_id": 3}]),
        "messages[0].tool_call_id",
        "must be a string",
    ),
]


@pytest.mark.parametrize("fields, field, message", BAD_PROMPTS)
def test_bad_prompt_forms(fields, field, message):
    with pytest.raises(RequestError) as info:
        check_one_prompt(**fields)
    assert info.value.field == field and message in str(info.value)


@pytest.mark.parametrize(
    "ids, field",
    [
        ([1, -1], "prompt_token_ids[1]"),
        ([4096], "prompt_token_ids[0]"),
        ([1, "2"], "prompt_token_ids[1]"),
        ([True], "prompt_token_ids[0]"),
    ],
)
def test_token_ids_outside_the_vocabulary(ids, field):
    with pytest.raises(RequestError, match=r"outside the vocabulary \[0, 4096\)") as info:
        check_token_ids(ids, LIMITS)
    assert info.value.field == field


def test_prompt_length_against_max_model_len():
    with pytest.raises(RequestError, match="2048 tokens leave no room to generate: max_model_len is 2048"):
        check_length(2048, sp(), LIMITS)
    with pytest.raises(
        RequestError, match=r"prompt \(2000 tokens\) \+ min_tokens \(100\) exceeds max_model_len \(2048\)"
    ):
        check_length(2000, sp(min_tokens=100, max_tokens=200), LIMITS)
    check_length(2000, sp(min_tokens=48, max_tokens=100), LIMITS)


@pytest.mark.parametrize("request_id, message", [("", "non-empty"), (5, "non-empty"), ("x" * 300, "at most 256")])
def test_bad_request_ids(request_id, message):
    with pytest.raises(RequestError, match=message):
        validate_request_id(request_id)


def test_good_requests_pass_unchanged():
    params = sp(
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        seed=3,
        logprobs=5,
        stop=["\n\n"],
        stop_token_ids=[2],
        max_tokens=64,
        min_tokens=4,
    )
    assert check_sampling(params, LIMITS) is params
    check_one_prompt("hello", None, None)
    check_one_prompt(None, None, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    check_one_prompt(
        None,
        None,
        [  # OpenAI's tool-call turns and text parts
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "use the tool",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "w"},
        ],
    )
    check_token_ids([0, 4095], LIMITS)
    validate_request_id("req-1")


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(prompt="hi", tools=[]), "tools"),
        (dict(prompt_token_ids=[1], chat_template_kwargs={"x": 1}), "chat_template_kwargs"),
        (
            dict(messages=[{"role": "user", "content": "x"}], chat_template_kwargs={"tools": []}),
            "chat_template_kwargs.tools",
        ),
    ],
)
def test_chat_options_belong_to_chat_requests_and_their_own_fields(fields, field):
    from fdcore.core.validation import check_chat_options
    from fdcore.protocol import RequestBody

    with pytest.raises(RequestError) as info:
        check_chat_options(RequestBody(**fields))
    assert info.value.field == field


def test_unset_sampling_fields_are_checked_as_they_will_be_filled():
    params = sp(min_tokens=16)  # max_tokens unset: 16
    assert check_sampling(params, LIMITS) is params and params.max_tokens is None
