"""The tokenizer a GGUF file describes, built with the ``tokenizers`` library (byte-level BPE or SentencePiece-style
BPE, its pre-tokenizer named by the file), and its tokenizer_config.json-like settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fdcore.checkpoint.gguf_metadata import Metadata, open_gguf

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from tokenizers.processors import PostProcessor

_CONTROL, _UNKNOWN, _USER_DEFINED = 3, 2, 4

# Split patterns, as llama.cpp and the models' own tokenizer.json files have them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How a byte-level vocabulary splits text before BPE: "gpt2" (the GPT-2 split built into
    ByteLevel), "digits" (each digit alone, then the GPT-2 split: StarCoder / SmolLM), or a
    regex; ``ignore_merges`` takes a whole word found in the vocabulary as is (Llama 3)."""

    split: str
    ignore_merges: bool = False


# tokenizer.ggml.pre -> pre-tokenizer; the names and groups are llama.cpp's (llama-vocab.cpp)
PRE_TOKENIZERS = {
    "gpt-2": _PreTokenizer("gpt2"),
    **{
        name: _PreTokenizer("digits")
        for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
    },
    **{
        name: _PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True)
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")
    },
    "dbrx": _PreTokenizer(_LLAMA3_SPLIT),
    "smaug-bpe": _PreTokenizer(_LLAMA3_SPLIT),
    "qwen2": _PreTokenizer(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _PreTokenizer(_QWEN2_SPLIT),
    "tekken": _PreTokenizer(_TEKKEN_SPLIT),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode), which byte-level vocabularies
    are spelled in: printable Latin-1 stands for itself, other bytes are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _split_merges(meta: Metadata, merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise meta.error("tokenizer.ggml.merges", f"merge {merge!r} is not two tokens")
        pairs.append((parts[0], parts[1]))
    return pairs


def _byte_level_bpe(meta: Metadata, tokens: list[str]) -> tuple[Tokenizer, set[str] | None]:
    """GPT-2-style byte-level BPE: tokens spelled in the byte alphabet, merges from the file."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # A token written in plain text (llama.cpp stores some added tokens that way) is respelled.
    vocab = {
        tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    pre_name = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre_name not in PRE_TOKENIZERS:
        raise meta.error(
            "tokenizer.ggml.pre",
            f"pre-tokenizer {pre_name!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}",
        )
    pre = PRE_TOKENIZERS[pre_name]
    merges = _split_merges(meta, meta.require("tokenizer.ggml.merges"))
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    if pre.split == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre.split == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, letters


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files carry scores, not merges: every split of a token into two tokens is a
    merge ranked by the token's score (higher first), ties by shorter left then right part, as
    transformers' generate_merges orders them (so both tokenizers agree)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    candidates = []
    for tok, score in zip(tokens, scores, strict=True):
        local = [(tok[:k], tok[k:], score) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
        candidates += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _sentencepiece_bpe(meta: Metadata, tokens: list[str]) -> tuple[Tokenizer, set[str] | None]:
    """SentencePiece-style BPE ("llama"): ▁ for spaces, byte fallback through <0xNN> tokens.

    The prefix ▁ comes from Metaspace(prepend_scheme="first"), as transformers builds these
    tokenizers: once, at the start of the text, and not after a special token (so "[INST] Hi"
    after BOS is not "▁[INST]"). It differs from sentencepiece (and llama.cpp) on a text that
    already starts with a space, which gets no extra ▁ here.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = _split_merges(meta, meta.get("tokenizer.ggml.merges"))
    else:
        merges = _merges_from_scores(tokens, meta.require("tokenizer.ggml.scores"))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, None


def _add_special_tokens(
    tokenizer: Tokenizer, tokens: list[str], types: list[int], letters: set[str] | None, named: set[int]
) -> None:
    """Control / unknown tokens (and the named bos/eos) become special, user-defined ones plain
    added tokens: either way matched whole in the text, never cut by BPE.

    In a byte-level vocabulary a "control" token spelled outside the byte alphabet is a llama.cpp
    mislabel of an ordinary token (adding it would grow the vocabulary): it is left alone.
    """
    from tokenizers import AddedToken

    vocab = tokenizer.get_vocab()
    special, plain = [], []
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind in (_CONTROL, _UNKNOWN) or i in named:
            if letters is None or set(tok) <= letters:
                special.append(AddedToken(tok, special=True, normalized=False))
        elif kind == _USER_DEFINED and vocab.get(tok) == i:
            plain.append(AddedToken(tok, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)


def _post_processor(meta: Metadata, tokens: list[str], default_bos: bool) -> PostProcessor | None:
    """BOS (and EOS) added on encode when the file says so (add_special_tokens=True)."""
    from tokenizers import processors

    single, specials = ["$A:0"], []
    for key, default, at_start in (("bos", default_bos, True), ("eos", False, False)):
        if not meta.get(f"tokenizer.ggml.add_{key}_token", default):
            continue
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None:
            raise meta.error(f"tokenizer.ggml.{key}_token_id", f"missing, but add_{key}_token is set")
        text = tokens[token_id]
        single.insert(0 if at_start else len(single), f"{text}:0")
        specials.append((text, token_id))
    if not specials:
        return None
    pair = single + [piece.replace("$A", "$B").replace(":0", ":1") for piece in single]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=specials)


def gguf_tokenizer(file: str) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer a GGUF file describes, and its tokenizer_config.json-like settings.

    Returns ``(tokenizer, settings)``:

    - ``tokenizer``: a ``tokenizers.Tokenizer``. ``tokenizer.ggml.model`` "gpt2" gives byte-level
      BPE with the pre-tokenizer ``tokenizer.ggml.pre`` names (see PRE_TOKENIZERS; absent: GPT-2's)
      and a ByteLevel decoder; "llama" gives SentencePiece-style BPE (Metaspace ▁, byte fallback,
      merges from the file or derived from the scores). Control tokens are added as special tokens,
      user-defined ones as plain added tokens; ``encode(text)`` (add_special_tokens=True) prepends
      BOS when ``tokenizer.ggml.add_bos_token`` says so (default: yes for "llama", no for "gpt2")
      and appends EOS when ``add_eos_token`` does.
    - ``settings``: ``{"chat_template": str | None, "bos_token": str | None, "eos_token": str | None}``
      (the template from ``tokenizer.chat_template``; the token texts of the bos/eos ids).

    Raises CheckpointError naming the file and key for an unknown tokenizer model or
    pre-tokenizer, or a missing vocabulary / merges.
    """
    reader = open_gguf(file)
    meta = Metadata(reader, file)
    model = meta.require("tokenizer.ggml.model")
    tokens = meta.require("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise meta.error("tokenizer.ggml.token_type", f"{len(types)} entries for {len(tokens)} tokens")
    if model == "gpt2":
        tokenizer, letters = _byte_level_bpe(meta, tokens)
    elif model == "llama":
        tokenizer, letters = _sentencepiece_bpe(meta, tokens)
    else:
        raise meta.error("tokenizer.ggml.model", f"tokenizer model {model!r} is not supported (gpt2, llama)")
    ids = {key: meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos")}
    for key, token_id in ids.items():
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise meta.error(f"tokenizer.ggml.{key}_token_id", f"{token_id} is outside the vocabulary")
    _add_special_tokens(tokenizer, tokens, types, letters, {i for i in ids.values() if i is not None})
    tokenizer.post_processor = _post_processor(meta, tokens, default_bos=model == "llama")
    settings = {
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": None if ids["bos"] is None else tokens[ids["bos"]],
        "eos_token": None if ids["eos"] is None else tokens[ids["eos"]],
    }
    return tokenizer, settings
