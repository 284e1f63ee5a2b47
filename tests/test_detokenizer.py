"""Incremental detokenization: no broken characters, stop strings honoured and never leaked."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from fdcore.core.detokenizer import IncrementalDetokenizer
from fdcore.models import tiny

TOKENIZER = Tokenizer.from_file(tiny.TOKENIZER)


def stream(text: str, prompt: str = "Hi", stop=None) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode(prompt).ids, stop)
    deltas = []
    for token in TOKENIZER.encode(text).ids:
        deltas.append(detok.add(token))
        if detok.stopped:
            break
    deltas.append(detok.finish())
    return deltas, detok


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab ,.\n") + ["é", "ß", "日", "本", "語", "🚀", "Ж", "ω"]), max_size=40))
def test_deltas_concatenate_to_the_text_and_never_hold_a_broken_character(text):
    deltas, _ = stream(text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_an_emoji_split_over_tokens_appears_only_when_whole():
    ids = TOKENIZER.encode("a🚀").ids
    assert len(ids) > 2  # the emoji takes several byte tokens
    detok = IncrementalDetokenizer(TOKENIZER, [], None)
    deltas = [detok.add(t) for t in ids]
    assert deltas[-1].endswith("🚀") and all("🚀" not in d for d in deltas[:-1])


@pytest.mark.parametrize("text, stop, shown", [
    ("hello world. goodbye", ["."], "hello world"),
    ("hello world. goodbye", ["wor"], "hello "),
    ("one two three four", ["three f", "xyz"], "one two "),
    ("no stop here", ["zzz"], "no stop here"),
])
def test_stop_strings_end_the_text_and_are_not_leaked(text, stop, shown):
    deltas, detok = stream(text, stop=stop)
    assert "".join(deltas) == shown
    assert detok.stopped == (shown != text)
    assert not any(s in "".join(deltas) for s in stop)


def test_a_partial_stop_string_is_held_back_until_it_cannot_match():
    detok = IncrementalDetokenizer(TOKENIZER, [], ["STOP!"])
    shown = "".join(detok.add(t) for t in TOKENIZER.encode("abc STO").ids)
    assert "STO" not in shown  # could still become STOP!
    shown += "".join(detok.add(t) for t in TOKENIZER.encode("x").ids) + detok.finish()
    assert shown == "abc STOx"
