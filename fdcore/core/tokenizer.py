"""The model's tokenizer and limits as the engine needs them: text, token ids and chat messages in.

Text goes through the ``tokenizers`` library with the checkpoint's own
``tokenizer.json`` (its post-processor adds BOS where the model wants it);
chat messages are rendered with the checkpoint's chat template
(:mod:`fdcore.core.chat_template`: found, sandboxed and compiled as Hugging
Face transformers does, once, here) and tokenized without adding special
tokens again.

NOTE: special-token text in anything a request supplies (a message's content or
name, tool and document fields, template variables: a user writing
``<|im_end|>``) is encoded as plain text, never as the control token: otherwise
a user could close their own turn and write the assistant's (transformers
matches it as the token unless asked for ``sanitize_control_tokens``). Where a
request holds such text, each occurrence is replaced before rendering by a
placeholder no request can forge (a per-render random nonce between private-use
characters), so every control-token text left in the rendered prompt is the
template's own: the prompt is split there, those become control tokens, and the
text between them (placeholders put back) is encoded with the special tokens
not matched. Every other prompt is encoded whole: exactly transformers' ids.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from tokenizers import Tokenizer

from fdcore.checkpoint import CheckpointError, eos_ids, is_gguf, read_config, read_json_object
from fdcore.checkpoint.model_args import context_length
from fdcore.core.chat_template import ChatOptions, ChatTemplates, prepare_messages, render
from fdcore.core.validation import (
    SPECIAL_TOKENS,
    ModelLimits,
    RequestError,
    check_chat_options,
    check_one_prompt,
    check_token_ids,
)

if TYPE_CHECKING:
    from fdcore.protocol import RequestBody

NO_OPTIONS = ChatOptions()  # a chat request's options when it sets none


class ModelTokenizer:
    def __init__(self, path: str):
        self.path = path
        self.tokenizer, settings, legacy_map = _tokenizer_files(path)
        config = read_config(path)
        self.vocab_size = int(config["vocab_size"])
        self.max_position_embeddings = context_length(config, path)
        self.eos_token_ids = eos_ids(path, config)
        self.special_tokens = special_tokens(settings, legacy_map)
        self.control_texts = [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        self.chat_templates = ChatTemplates.load(path, settings)  # compiled now: a broken one stops the start

    def limits(self, max_model_len: int, cache_tokens: int) -> ModelLimits:
        """What a request may use: the vocabulary, and the shortest of the configured context, the
        model's positions and the KV cache."""
        return ModelLimits(self.vocab_size, min(max_model_len, self.max_position_embeddings, cache_tokens))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def render_chat(self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS) -> str:
        """The prompt text of checked messages (RequestError naming the field when it cannot be made)."""
        template = self.chat_templates.select(options.template, options.tools)
        return render(template, prepare_messages(messages), options, self.special_tokens)

    def encode_chat(self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS) -> list[int]:
        """The prompt's ids; control-token text from the request (anywhere in it) is encoded as text."""
        supplied = (messages, options.tools, options.documents, options.variables)
        if not any(self._controls(text) for text in _strings(supplied)):
            return self.tokenizer.encode(self.render_chat(messages, options), add_special_tokens=False).ids
        shield = _Shield(self.control_texts)
        messages, tools, documents, variables = shield.hide(supplied)
        text = self.render_chat(
            messages,
            ChatOptions(
                tools,
                documents,
                options.add_generation_prompt,
                options.continue_final_message,
                variables,
                options.template,
            ),
        )
        ids = []
        for piece, control in shield.split(text):
            if piece:
                ids += (
                    self._encode_as_text(shield.reveal(piece))
                    if shield.hides(piece)
                    else (self.tokenizer.encode(piece, add_special_tokens=False).ids)
                )
            if control is not None:
                ids.append(cast(int, self.tokenizer.token_to_id(control)))
        return ids

    def prompt_ids(self, body: RequestBody, limits: ModelLimits) -> list[int]:
        """A request body's prompt (fdcore.protocol.RequestBody: text, token ids or chat messages) as
        token ids, checked: one prompt form, chat options only with messages, ids inside the
        vocabulary, not empty. What the engine runs and what /tokenize counts."""
        check_one_prompt(body.prompt, body.prompt_token_ids, body.messages)
        check_chat_options(body)
        if body.prompt_token_ids is not None:
            ids = list(body.prompt_token_ids)
            check_token_ids(ids, limits)
        elif body.messages is not None:
            ids = self.encode_chat(body.messages, chat_options(body))
        else:
            ids = self.encode(cast(str, body.prompt))
        if not ids:
            raise RequestError("prompt", "tokenizes to no tokens")
        return ids

    def _controls(self, content: str) -> bool:
        return any(control in content for control in self.control_texts)

    def _encode_as_text(self, text: str) -> list[int]:
        self.tokenizer.encode_special_tokens = True
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self.tokenizer.encode_special_tokens = False


def chat_options(body: RequestBody) -> ChatOptions:
    """How to render a chat request; a continued final message gets no generation prompt unless asked."""
    continuing = bool(body.continue_final_message)
    prompt = not continuing if body.add_generation_prompt is None else body.add_generation_prompt
    return ChatOptions(body.tools, body.documents, prompt, continuing, body.chat_template_kwargs, body.chat_template)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a request's nested lists and dicts (keys too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


class _Shield:
    """Control-token text of one request swapped for placeholders nobody can forge, and back."""

    def __init__(self, control_texts: list[str]):
        nonce = secrets.token_hex(8)
        self.controls = sorted(control_texts, key=len, reverse=True)  # a longer one first where they overlap
        self.placeholders = {f"\ue000{nonce}{i:x}\ue001": text for i, text in enumerate(self.controls)}
        self._find_control = re.compile("|".join(map(re.escape, self.controls)))
        self._find_placeholder = re.compile(f"\ue000{nonce}[0-9a-f]+\ue001")
        self._by_text = {text: placeholder for placeholder, text in self.placeholders.items()}

    def hide(self, value: Any) -> Any:
        """``value`` (strings, lists, tuples, dicts) with every control text in its strings replaced."""
        if isinstance(value, str):
            return self._find_control.sub(lambda m: self._by_text[m.group(0)], value)
        if isinstance(value, dict):
            return {self.hide(key): self.hide(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.hide(item) for item in value)
        return value

    def split(self, text: str) -> Iterator[tuple[str, str | None]]:
        """(text, the template's control text after it or None) pieces of a rendered prompt."""
        cursor = 0
        for match in self._find_control.finditer(text):
            yield text[cursor : match.start()], match.group(0)
            cursor = match.end()
        yield text[cursor:], None

    def hides(self, text: str) -> bool:
        return self._find_placeholder.search(text) is not None

    def reveal(self, text: str) -> str:
        return self._find_placeholder.sub(lambda m: self.placeholders[m.group(0)], text)


def load_tokenizer(path: str) -> Tokenizer:
    """Just the checkpoint's tokenizer (what a worker needs to match grammars)."""
    return _tokenizer_files(path)[0]


def _tokenizer_files(path: str) -> tuple[Tokenizer, dict[str, Any], dict[str, Any]]:
    """(tokenizer, tokenizer_config.json settings, special_tokens_map.json) of a checkpoint
    directory, or the same built from a GGUF file's metadata."""
    if is_gguf(path):
        from fdcore.checkpoint.gguf_tokenizer import gguf_tokenizer

        tokenizer, settings = gguf_tokenizer(path)
        return tokenizer, {k: v for k, v in settings.items() if v is not None}, {}
    file = os.path.join(path, "tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as exc:  # missing or not a tokenizer: the checkpoint's fault, named
        raise CheckpointError(f"{file}: cannot be read as a tokenizer ({exc})") from None
    return (
        tokenizer,
        read_json_object(os.path.join(path, "tokenizer_config.json"), missing_ok=True),
        read_json_object(os.path.join(path, "special_tokens_map.json"), missing_ok=True),
    )


def special_tokens(settings: dict[str, Any], legacy_map: dict[str, Any]) -> dict[str, str]:
    """The named special tokens as template variables (transformers' ``special_tokens_map``): from
    tokenizer_config.json, else special_tokens_map.json; unset ones are left undefined."""
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = _token_text(settings.get(name, legacy_map.get(name)))
        if value is not None:
            tokens[name] = value
    return tokens


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json gives special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
