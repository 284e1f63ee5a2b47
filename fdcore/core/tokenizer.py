"""The model's tokenizer and limits as the engine needs them: text, token ids and chat messages in.

Text goes through the ``tokenizers`` library with the checkpoint's own
``tokenizer.json`` (its post-processor adds BOS where the model wants it);
chat messages are rendered with the checkpoint's chat template
(:mod:`fdcore.core.chat_template`: found, sandboxed and compiled as Hugging
Face transformers does, once, here) and tokenized without adding special
tokens again.

NOTE: special-token text inside a message's content (a user writing
``<|im_end|>``) is encoded as plain text, never as the control token: otherwise
a user could close their own turn and write the assistant's (transformers
matches it as the token unless asked for ``sanitize_control_tokens``). The
rendered prompt is split at the contents that hold such text; only those spans
are encoded with the special tokens not matched, so every other prompt's ids
stay exactly transformers'.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from fdcore.core.chat_template import ChatOptions, ChatTemplates, prepare_messages, render
from fdcore.core.validation import ModelLimits, RequestError, check_chat_options, check_one_prompt, check_token_ids
from fdcore.models.loader import CheckpointError, eos_ids, is_gguf, read_config, read_json_object

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens every template may use
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ModelTokenizer:
    def __init__(self, path: str):
        self.path = path
        self.tokenizer, settings, legacy_map = _tokenizer_files(path)
        config = read_config(path)
        self.vocab_size = int(config["vocab_size"])
        self.max_position_embeddings = int(config.get("max_position_embeddings", 2048))
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

    def render_chat(self, messages: list[dict], options: ChatOptions = ChatOptions()) -> str:
        """The prompt text of checked messages (RequestError naming the field when it cannot be made)."""
        template = self.chat_templates.select(options.template, options.tools)
        return render(template, prepare_messages(messages), options, self.special_tokens)

    def encode_chat(self, messages: list[dict], options: ChatOptions = ChatOptions()) -> list[int]:
        """The prompt's ids; control-token text inside message contents is encoded as text."""
        text = self.render_chat(messages, options)
        contents = [m.get("content") for m in prepare_messages(messages)]
        ids, cursor = [], 0
        for start, end in _spans_of(text, [c for c in contents if isinstance(c, str) and self._controls(c)]):
            ids += self.tokenizer.encode(text[cursor:start], add_special_tokens=False).ids
            ids += self._encode_as_text(text[start:end])
            cursor = end
        return ids + self.tokenizer.encode(text[cursor:], add_special_tokens=False).ids

    def prompt_ids(self, body, limits: ModelLimits) -> list[int]:
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
            ids = self.encode(body.prompt)
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


def chat_options(body) -> ChatOptions:
    """How to render a chat request; a continued final message gets no generation prompt unless asked."""
    continuing = bool(body.continue_final_message)
    prompt = not continuing if body.add_generation_prompt is None else body.add_generation_prompt
    return ChatOptions(body.tools, body.documents, prompt, continuing, body.chat_template_kwargs, body.chat_template)


def _spans_of(text: str, contents: list[str]) -> list[tuple[int, int]]:
    """Where each content (in message order) sits in the rendered prompt; a template that changed a
    content's edges (``| trim``) is matched on the stripped text."""
    spans, cursor = [], 0
    for content in contents:
        for candidate in (content, content.strip()):
            start = text.find(candidate, cursor) if candidate else -1
            if start >= 0:
                spans.append((start, start + len(candidate)))
                cursor = start + len(candidate)
                break
    return spans


def load_tokenizer(path: str) -> Tokenizer:
    """Just the checkpoint's tokenizer (what a worker needs to match grammars)."""
    return _tokenizer_files(path)[0]


def _tokenizer_files(path: str) -> tuple[Tokenizer, dict, dict]:
    """(tokenizer, tokenizer_config.json settings, special_tokens_map.json) of a checkpoint
    directory, or the same built from a GGUF file's metadata."""
    if is_gguf(path):
        from fdcore.models.gguf import gguf_tokenizer

        tokenizer, settings = gguf_tokenizer(path)
        return tokenizer, {k: v for k, v in settings.items() if v is not None}, {}
    file = os.path.join(path, "tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as exc:  # missing or not a tokenizer: the checkpoint's fault, named
        raise CheckpointError(f"{file}: cannot be read as a tokenizer ({exc})") from None
    return (tokenizer, read_json_object(os.path.join(path, "tokenizer_config.json"), missing_ok=True),
            read_json_object(os.path.join(path, "special_tokens_map.json"), missing_ok=True))


def special_tokens(settings: dict, legacy_map: dict) -> dict[str, str]:
    """The named special tokens as template variables (transformers' ``special_tokens_map``): from
    tokenizer_config.json, else special_tokens_map.json; unset ones are left undefined."""
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = _token_text(settings.get(name, legacy_map.get(name)))
        if value is not None:
            tokens[name] = value
    return tokens


def _token_text(value) -> str | None:
    """tokenizer_config.json gives special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
