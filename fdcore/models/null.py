"""The null model: answers every step at once with a fixed token per position.

With it, a run through the actor tree measures fdcore's own per-step cost
(scheduling, messages, detokenization, streaming) and nothing of the model
(``[model] backend = "null"``; ``benchmarks/bench_throughput.py --null``).
Tokens are a function of the position, never an EOS id, so requests run to
``max_tokens``.
"""

from __future__ import annotations

from fdcore.checkpoint import eos_ids, read_config


class NullModel:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_path(cls, path: str) -> NullModel:
        config = read_config(path)
        return cls(int(config["vocab_size"]), eos_ids(path, config))

    def next_token(self, position: int) -> int:
        token = 3 + (position * 7919) % (self.vocab_size - 3)
        return token if token not in self.eos_token_ids else 3
