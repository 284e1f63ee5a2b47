"""The bundled tiny model: made offline, deterministically, in Hugging Face's layout."""

from __future__ import annotations

import json
import os

from safetensors.numpy import load_file
from tokenizers import Tokenizer

from fdcore.checkpoint import tiny


def test_two_makes_are_byte_identical_and_complete(tmp_path):
    a = tiny.make_tiny_model(str(tmp_path / "a"))
    b = tiny.make_tiny_model(str(tmp_path / "b"))
    assert tiny.digest(a) == tiny.digest(b)
    assert sorted(os.listdir(a)) == sorted(tiny.FILES)
    assert tiny.is_complete(a)
    assert tiny.make_tiny_model(str(tmp_path / "c"), seed=1) and tiny.digest(str(tmp_path / "c")) != tiny.digest(a)


def test_weights_match_the_config_shapes(tmp_path):
    path = tiny.make_tiny_model(str(tmp_path / "m"))
    config = json.load(open(os.path.join(path, "config.json")))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    assert tensors["model.embed_tokens.weight"].shape == (vocab, hidden)
    assert tensors["model.layers.3.self_attn.k_proj.weight"].shape == (kv, hidden)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (hidden, config["intermediate_size"])
    assert len([k for k in tensors if k.startswith("model.layers.")]) == 9 * config["num_hidden_layers"]


def test_the_tokenizer_round_trips_any_text_and_knows_its_special_tokens(tmp_path):
    path = tiny.make_tiny_model(str(tmp_path / "m"))
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    for text in ["def f(x): return x", "Grüße 日本語 🚀 \x00\ttabs", ""]:
        assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(t) for t in ("<s>", "</s>")] == [1, 2]


def test_ensure_makes_once_and_remakes_an_incomplete_directory(tmp_path):
    path = str(tmp_path / "m")
    tiny.ensure_tiny_model(path)
    stamp = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    tiny.ensure_tiny_model(path)
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == stamp
    os.remove(os.path.join(path, "model.safetensors"))
    tiny.ensure_tiny_model(path)
    assert tiny.is_complete(path)
