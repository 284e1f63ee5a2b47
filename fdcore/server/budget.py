"""How big a response a request asks for, checked before any work starts (``server.max_response_entries``).

A response lists tokens: each choice's output tokens, each with its top-N logprobs when asked, and for
completions' ``echo`` and vLLM's ``prompt_logprobs`` the prompt's tokens likewise. A request for 64
choices of a 2,000-token prompt echoed with 20 logprobs and 20 prompt logprobs asks for 5.4 million
such entries, ~200 MB of JSON: no client needs it, and building it is seconds of one process's time.
Such a request is a 400 naming the fields that make it big, before the engine sees it.

The prompt's length is known exactly for token ids; for text, :func:`text_tokens_bound` bounds it (a
token is at least one byte of its text), and the caller tokenizes only when the bound is over budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from fdcore.server.schemas import BadRequest


@dataclass(frozen=True)
class Ask:
    """What one choice lists: up to ``max_tokens`` output tokens with ``top`` logprobs each (None: no
    logprobs), and the prompt's ``prompt_tokens`` with ``echo_top`` (echo) and ``scored_top``
    (prompt_logprobs) entries each (None: not listed)."""

    max_tokens: int
    top: int | None = None
    prompt_tokens: int = 0
    echo_top: int | None = None
    scored_top: int | None = None

    def entries(self) -> int:
        listed = self.max_tokens * (1 + (self.top or 0))
        for top in (self.echo_top, self.scored_top):
            if top is not None:
                listed += self.prompt_tokens * (1 + top)
        return listed


def text_tokens_bound(text: str, max_model_len: int) -> int:
    """At most how many tokens a text prompt becomes (its bytes, plus the special tokens a template or
    post-processor may add), never more than the context."""
    return min(len(text.encode("utf-8", "surrogatepass")) + 8, max_model_len)


def check(asks: list[Ask], limit: int, fields: str) -> None:
    """BadRequest when the choices together list more than ``limit`` entries; ``fields`` names what
    the request asked (e.g. "n, max_tokens, logprobs, echo")."""
    total = sum(ask.entries() for ask in asks)
    if total > limit:
        raise BadRequest(
            f"This request's response would list {total:,} tokens and logprobs ({fields}), more than "
            f"the {limit:,} a response may list (server.max_response_entries): ask for fewer",
            fields.split(",")[0].strip(),
        )
