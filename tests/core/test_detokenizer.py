"""Incremental detokenization: no broken characters, stop strings honoured and never leaked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from fdcore.checkpoint import tiny
from fdcore.core.detokenizer import IncrementalDetokenizer

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


@pytest.mark.parametrize(
    "text, stop, shown",
    [
        ("hello world. goodbye", ["."], "hello world"),
        ("hello world. goodbye", ["wor"], "hello "),
        ("one two three four", ["three f", "xyz"], "one two "),
        ("no stop here", ["zzz"], "no stop here"),
    ],
)
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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, TOKENIZER.get_vocab_size() - 1), max_size=30))
def test_any_token_sequence_detokenizes_like_the_tokenizer(ids):
    detok = IncrementalDetokenizer(TOKENIZER, [], None)
    assert detok.table is not None  # the byte-level fast path
    text = "".join(detok.add(t) for t in ids) + detok.finish()
    assert text == TOKENIZER.decode(ids)


def test_sentencepiece_style_byte_fallback_detokenizes_like_the_tokenizer():
    import json

    vocab = {"<unk>": 0, "<s>": 1, "\u2581hi": 2, "x": 3, "<0xC3>": 4, "<0xA9>": 5, "<0x41>": 6, "\u2581": 7}
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "added_tokens": [
            {
                "id": 1,
                "content": "<s>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "vocab": vocab,
            "merges": [],
        },
    }
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    ids = [3, 2, 4, 5, 6, 1, 7, 2, 4]  # x, ' hi', é as two bytes, 'A', <s>, ' ', ' hi', a dangling byte
    detok = IncrementalDetokenizer(tokenizer, [3], None)
    assert detok.table is not None
    text = "".join(detok.add(t) for t in ids) + detok.finish()
    assert text == tokenizer.decode(ids) == "x hiéA  hi\ufffd"
