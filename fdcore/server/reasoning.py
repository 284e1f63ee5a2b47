"""reasoning_content: a thinking model's ``<think> ... </think>`` apart from its answer (vLLM's and
FastDeploy's ``reasoning_parser``), chosen by ``server.reasoning_parser``:

- ``deepseek_r1``: the answer begins in thought (its template opens ``<think>`` in the prompt, so the
  output may lack the tag): everything before ``</think>`` is reasoning, all of it if the tag never
  comes;
- ``qwen3``: reasoning only when the output opens with ``<think>`` (thinking can be switched off,
  and then the whole output is the answer).

The answer's leading newlines (the template's after ``</think>``) are dropped. Streamed,
:class:`ReasoningStream` gives the same split piece by piece, holding back only what may be a tag.
"""

from __future__ import annotations

PARSERS = ("", "deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"
REASONING, CONTENT = "reasoning_content", "content"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A whole output as (reasoning or None, the answer)."""
    stream = ReasoningStream(parser)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(piece for field, piece in pieces if field == REASONING)
    return reasoning or None, "".join(piece for field, piece in pieces if field == CONTENT)


class ReasoningStream:
    """``feed(text)`` / ``finish()`` -> [(REASONING or CONTENT, text)] in order."""

    def __init__(self, parser: str):
        self.parser = parser
        self.state = "start" if parser else CONTENT
        self.held = ""
        self.answered = False  # the answer's first character went out (leading newlines before it are dropped)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            if self.held.startswith(OPEN):
                self.held, self.state = self.held[len(OPEN) :], REASONING
            elif OPEN.startswith(self.held):
                return out  # may still become the tag
            else:
                self.state = REASONING if self.parser == "deepseek_r1" else CONTENT
        if self.state == REASONING:
            end = self.held.find(CLOSE)
            if end < 0:
                keep = tag_prefix(self.held, CLOSE)
                out += _piece(REASONING, self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return out
            out += _piece(REASONING, self.held[:end])
            self.held, self.state = self.held[end + len(CLOSE) :], CONTENT
        return out + self._answer()

    def _answer(self) -> list[tuple[str, str]]:
        text, self.held = self.held, ""
        if not self.answered:
            text = text.lstrip("\n")
            self.answered = bool(text)
        return _piece(CONTENT, text)

    def finish(self) -> list[tuple[str, str]]:
        """What is still held: an unfinished thought stays reasoning; an opening that never became
        the tag is the answer."""
        if self.state == REASONING:
            text, self.held = self.held, ""
            return _piece(REASONING, text)
        self.state = CONTENT
        return self._answer()


def _piece(field: str, text: str) -> list[tuple[str, str]]:
    return [(field, text)] if text else []


def tag_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
