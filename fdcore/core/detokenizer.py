"""Incremental detokenization with stop strings: text deltas safe to show a user.

Byte-level BPE tokens do not align with characters: one emoji may take four
tokens, and decoding a prefix of them yields U+FFFD. The ``tokenizers``
library's ``DecodeStream`` turns each token into the text it completes (none
while a character is still partial), primed with the prompt's last tokens so
that the first word gets its leading space right. On top of it this class
holds back the last ``len(longest stop) - 1``
characters, so a stop string that arrives split over several tokens is never
shown in part. When a stop string completes, the text before it is emitted and
the request finishes with ``stop`` (the stop string itself is not included).
"""

from __future__ import annotations

class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a ModelTokenizer or a Tokenizer
        self.stream = DecodeStream(ids=list(prompt_token_ids[-6:]), skip_special_tokens=True)
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""       # all final output text so far (stop string excluded)
        self.emitted = 0     # characters of ``text`` already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the new text that may be shown now."""
        if self.stopped:
            return ""
        piece = self.stream.step(self.tokenizer, token_id)
        if piece:
            self.text += piece
        return self._release()

    def finish(self) -> str:
        """The request ended for another reason: hand out whatever was held back."""
        if self.stopped:
            return ""
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out

    def _release(self) -> str:
        for stop in self.stop:
            at = self.text.find(stop, max(0, self.emitted - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                out = self.text[self.emitted:]
                self.emitted = len(self.text)
                return out
        safe = len(self.text) - self.hold
        if safe <= self.emitted:
            return ""
        out = self.text[self.emitted:safe]
        self.emitted = safe
        return out
