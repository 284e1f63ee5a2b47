"""The model's tokenizer and limits as the engine needs them: text, token ids and chat messages in.

Text goes through the ``tokenizers`` library with the checkpoint's own
``tokenizer.json`` (its post-processor adds BOS where the model wants it);
chat messages are rendered with the checkpoint's Jinja chat template from
``tokenizer_config.json`` in a sandbox (as Hugging Face does) and tokenized
without adding special tokens again.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer

from fdcore.core.validation import RequestError
from fdcore.models.loader import eos_ids, read_config


class ModelTokenizer:
    def __init__(self, path: str):
        self.path = path
        self.tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config = read_config(path)
        self.vocab_size = int(config["vocab_size"])
        self.max_position_embeddings = int(config.get("max_position_embeddings", 2048))
        self.eos_token_ids = eos_ids(path, config)
        settings = _read_optional_json(os.path.join(path, "tokenizer_config.json"))
        self.chat_template = settings.get("chat_template")
        self.special = {name: _token_text(settings.get(name)) for name in ("bos_token", "eos_token")}
        self._template = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def render_chat(self, messages: list[dict]) -> str:
        if not self.chat_template:
            raise RequestError("messages", f"the model at {self.path} has no chat template "
                                           "(tokenizer_config.json: chat_template); send a prompt instead")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.special)
        except RequestError:
            raise
        except Exception as exc:  # a template that cannot render these messages
            raise RequestError("messages", f"the chat template failed on these messages: {exc}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids


def _raise_template_error(message: str):
    raise RequestError("messages", message)


def _read_optional_json(file: str) -> dict:
    if not os.path.exists(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value) -> str:
    """tokenizer_config.json gives special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""
