"""Structured outputs: a request's language (JSON schema, regex, choice, Lark / GBNF grammar) compiled
by llguidance, checked by the engine, matched token by token in the worker.

Where each part runs, and why:

- the engine turns every form into one llguidance grammar and checks it against the model's tokenizer
  (:meth:`Grammars.check`), so a schema that cannot compile is a 400 naming the field before anything
  is queued, and what the workers receive is already the one form they understand;
- the worker holds one matcher per constrained sequence (:meth:`Grammars.matcher`): it draws the
  tokens, so it advances the matcher as it draws, with no round trip (two steps in flight see each
  other's tokens in order). A sequence the worker sees again (a new worker after a crash, a
  preempted and recomputed one) gets a fresh matcher that replays the tokens it already has: the same
  state, so the same masks and, with seeded sampling, the same tokens;
- the masks of a step are computed from tokens the worker already has, so they are filled on a
  thread while the model's forward runs (llguidance drops the GIL), and compiling a grammar the
  process has not seen happens there too.

NOTE: JSON is constrained to ``json.dumps``' separators with no other whitespace. llguidance's
default allows any whitespace between tokens, and a model that keeps choosing a space (a random one
does, a small one may) never finishes its object; the output is the same JSON either way.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Sized
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fdcore.core.productive import empty_start
from fdcore.core.token_mask import mask_words
from fdcore.core.validation import RequestError
from fdcore.protocol import StructuredOutputs

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions
    from tokenizers import Tokenizer

FIELD = "structured_outputs"
FORMS = ("json", "regex", "choice", "grammar", "json_object", "llguidance")
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 256 * 1024  # a compiled grammar travels with its request through two rings
MAX_CHOICES = 1024
CACHED_GRAMMARS = 256  # compiled grammars (and verdicts) one process keeps, least recently used dropped


def grammar_of(spec: StructuredOutputs) -> tuple[str, str]:
    """(the field that gave it, its llguidance grammar) of a request's structured_outputs; a form that
    is not given right is a RequestError naming it. Syntax errors are found by :meth:`Grammars.check`."""
    import llguidance

    given = [form for form in FORMS if getattr(spec, form) not in (None, False)]
    if not given:
        raise RequestError(FIELD, f"give one of {', '.join(FORMS)}")
    if len(given) > 1:
        raise RequestError(f"{FIELD}.{given[1]}", f"give only one of {', '.join(FORMS)} (got {', '.join(given)})")
    form = given[0]
    field = f"{FIELD}.{form}"
    if form == "json":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_schema(field, spec.json), defaults=JSON_OPTIONS)
    elif form == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    elif form == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(_text(field, spec.regex))
    elif form == "choice":
        grammar = llguidance.LLMatcher.grammar_from_lark(_choice_grammar(field, spec.choice))
    elif form == "grammar":
        try:
            grammar = llguidance.grammar_from("grammar", _text(field, spec.grammar))
        except ValueError as exc:
            raise RequestError(field, str(exc)) from None
    else:
        grammar = _text(field, spec.llguidance)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise RequestError(field, f"compiles to {len(grammar)} characters, at most {MAX_GRAMMAR_CHARS} allowed")
    return field, grammar


def _schema(field: str, schema: Any) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise RequestError(field, f"is not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise RequestError(field, "must be a JSON schema object")
    return schema


def _text(field: str, text: Any) -> str:
    _non_empty(field, text, str, "a non-empty string", MAX_GRAMMAR_CHARS, "characters")
    return cast(str, text)


def _choice_grammar(field: str, choices: Any) -> str:
    _non_empty(field, choices, list, "a non-empty list of strings", MAX_CHOICES, "choices")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise RequestError(f"{field}[{i}]", "must be a non-empty string")
    return "start: " + " | ".join(json.dumps(choice) for choice in choices)


def _non_empty(field: str, value: Any, kind: type[Sized], what: str, limit: int, unit: str) -> None:
    if not isinstance(value, kind) or not value:
        raise RequestError(field, f"must be {what}")
    if len(value) > limit:
        raise RequestError(field, f"has {len(value)} {unit}, at most {limit} allowed")


class Grammars:
    """One process's llguidance tokenizer and compiled grammars, for one model's vocabulary.

    ``tokenizer`` is the model's ``tokenizers.Tokenizer``; masks are ``vocab_size`` wide (the model's
    logits; ids past the tokenizer's are never allowed) and allow ``eos_token_ids`` where the grammar
    may end. The llguidance tokenizer is built on first use (tenths of a second for a large
    vocabulary), so a server that never sees a constrained request never pays for it.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._executor: LLExecutor | None = None
        self._verdicts: OrderedDict[str, str] = OrderedDict()  # grammar -> "" or its error
        self._pristine: OrderedDict[str, LLMatcher] = OrderedDict()  # grammar -> a matcher before any token

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            import llguidance

            try:
                self._tokenizer = llguidance.LLTokenizer(
                    self._source.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            except Exception as exc:  # the model's, not the request's: refused, never a crash of the engine
                raise RequestError(FIELD, f"this model's tokenizer cannot drive a grammar ({exc})", 501) from None
        return self._tokenizer

    # ------------------------------------------------------------------ engine
    def check(self, spec: StructuredOutputs) -> StructuredOutputs:
        """The request's constraint compiled to llguidance's form, or a RequestError naming the field
        and what llguidance found wrong (checked against this tokenizer, cached by grammar)."""
        import llguidance

        field, grammar = grammar_of(spec)
        error = self._verdicts.get(grammar)
        if error is None:
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
            error = f"cannot be compiled: {error.strip()}" if error else self._empty_language(field, grammar)
            _remember(self._verdicts, grammar, error)
        else:
            self._verdicts.move_to_end(grammar)
        if error:
            raise RequestError(field, error)
        return StructuredOutputs(llguidance=grammar)

    def _empty_language(self, field: str, grammar: str) -> str:
        """'' for a language with some text in it, else why it has none: a matcher that fails before its
        first token (a regex matching nothing, a schema that is only a reference to itself), or a Lark
        start rule that derives nothing (fdcore.core.productive). Such a request would be served text
        outside its language (the end of text is all an empty language allows)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        matcher.compute_bitmask()  # (a matcher finds out at its first mask)
        if matcher.is_error():
            return "admits no output: no text belongs to its language"
        if field == f"{FIELD}.grammar" and empty_start(grammar):  # (Lark text: GBNF was converted)
            return "admits no output: its start rule derives no text (every way through it recurses for ever)"
        return ""

    # ------------------------------------------------------------------ worker
    def matcher(self, grammar: str, replay: list[int]) -> LLMatcher:
        """A matcher for a sequence that already has ``replay`` (its output tokens so far). A grammar
        that fails here (the engine checked it, so: a resource limit) leaves the matcher in its error
        state, which allows only EOS: the request ends instead of the worker."""
        import llguidance

        pristine = self._pristine.get(grammar)
        if pristine is None:
            pristine = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            _remember(self._pristine, grammar, pristine)
        else:
            self._pristine.move_to_end(grammar)
        matcher = pristine.deep_copy()
        if replay:
            matcher.consume_tokens(list(replay))
        return matcher

    def allowed(self, matchers: list[LLMatcher]) -> np.ndarray:
        """[len(matchers), (vocab_size + 31) // 32] int32: the tokens each matcher allows next, bit
        t % 32 of word t // 32 (filled in parallel, without the GIL; :func:`fdcore.core.token_mask.allowed_tokens`
        unpacks a row)."""
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, os.cpu_count() or 1))
        bits = np.zeros((len(matchers), mask_words(self.vocab_size)), dtype=np.int32)
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bits)
        return bits


def _remember(cache: OrderedDict[str, Any], key: str, value: Any) -> None:
    cache[key] = value
    if len(cache) > CACHED_GRAMMARS:
        cache.popitem(last=False)
