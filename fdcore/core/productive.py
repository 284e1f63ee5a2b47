"""Whether a Lark grammar's start rule can derive any text at all (a grammar whose language is empty).

llguidance parses lazily, token by token: a rule with no way out (``start: "a" start``) compiles, and its
matcher allows "a" for ever and never the end, so a request held to it is served text outside any
language. This is the textbook productivity check: a symbol is productive when some alternative of it
has every required item productive (strings and regular expressions are; an item marked ``?`` or
``*``, or inside ``[...]``, is not required), computed to a fixed point.

It reads the Lark text conservatively: anything it does not understand (a directive, an operator it
does not know, a symbol defined elsewhere) counts as productive, so it may miss an empty language but
never refuses a grammar that has one.
"""

from __future__ import annotations

import re
from typing import cast

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?\d+)?)
  | (?P<op>\.\.|->|[|()\[\]?*+~:])
  | (?P<number>\d+)
  | (?P<space>\s+|//[^\n]*)
  | (?P<other>.)""",
    re.X,
)


def empty_start(lark: str, start: str = "start") -> bool:
    """True only when the grammar certainly derives no text from ``start``."""
    rules = _rules(lark)
    if rules is None or start not in rules:
        return False
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in productive and _derives(body, rules, productive):
                productive.add(name)
                changed = True
    return start not in productive


def _rules(lark: str) -> dict[str, list[tuple[str, str]]] | None:
    """Each rule's or terminal's body as (kind, text) tokens; None where the text is beyond this reader."""
    rules: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in lark.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if stripped.startswith("%llguidance"):
            continue  # llguidance's options (what a GBNF grammar is converted to begins with them)
        if stripped.startswith("%"):
            return None  # imports, ignores, llguidance's extensions: not this reader's
        head = re.match(r"^\s*[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?\s*:(.*)$", line)
        if head and not line[:1].isspace():
            current = head.group(1)
            body = head.group(2)
        elif current is not None:
            body = line
        else:
            return None
        tokens = [(cast(str, m.lastgroup), m.group()) for m in _TOKEN.finditer(body) if m.lastgroup != "space"]
        if any(kind == "other" for kind, _ in tokens):
            return None
        if current in rules and head:
            rules[current].append(("op", "|"))
        rules.setdefault(current, []).extend(tokens)
    return rules


def _derives(body: list[tuple[str, str]], rules: dict[str, list[tuple[str, str]]], productive: set[str]) -> bool:
    """Some alternative of ``body`` has every required item productive."""
    try:
        value, rest = _alternatives(body, 0, rules, productive)
    except _Unreadable:
        return True
    return value if rest == len(body) else True


class _Unreadable(Exception):
    pass


def _alternatives(
    body: list[tuple[str, str]], i: int, rules: dict[str, list[tuple[str, str]]], productive: set[str]
) -> tuple[bool, int]:
    any_ok, i = _sequence(body, i, rules, productive)
    while i < len(body) and body[i] == ("op", "|"):
        ok, i = _sequence(body, i + 1, rules, productive)
        any_ok = any_ok or ok
    return any_ok, i


def _sequence(
    body: list[tuple[str, str]], i: int, rules: dict[str, list[tuple[str, str]]], productive: set[str]
) -> tuple[bool, int]:
    all_ok = True
    while i < len(body) and body[i] not in (("op", "|"), ("op", ")"), ("op", "]")):
        kind, text = body[i]
        if kind == "op" and text == "->":  # an alias names the alternative: the rest of it is a name
            i += 2
            continue
        ok, i = _atom(body, i, rules, productive)
        if i < len(body) and body[i] in (("op", "?"), ("op", "*")):
            ok, i = True, i + 1
        elif i < len(body) and body[i] == ("op", "+"):
            i += 1
        elif i < len(body) and body[i] == ("op", "~"):
            i += 2 if i + 1 < len(body) and body[i + 1][0] == "number" else 1
            if i < len(body) and body[i] == ("op", ".."):
                i += 2
        all_ok = all_ok and ok
    return all_ok, i


def _atom(
    body: list[tuple[str, str]], i: int, rules: dict[str, list[tuple[str, str]]], productive: set[str]
) -> tuple[bool, int]:
    kind, text = body[i]
    if kind in ("string", "regex"):
        return True, i + 1
    if kind == "name":
        name = text.lstrip("?!").split(".")[0]
        return (name in productive or name not in rules), i + 1
    if (kind, text) in (("op", "("), ("op", "[")):
        closing = ")" if text == "(" else "]"
        ok, i = _alternatives(body, i + 1, rules, productive)
        if i >= len(body) or body[i] != ("op", closing):
            raise _Unreadable(text)
        return (True if closing == "]" else ok), i + 1
    raise _Unreadable(text)
