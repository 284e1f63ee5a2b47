"""What one step asks of the model: the scheduler's output, in the model's terms.

It lives in ``core`` (like vLLM's ``SchedulerOutput``) because the scheduling
side fills it (``EngineCore``, the worker actor from a scheduler's ``Step``)
and every model consumes it: the layer that produces a type owns it, so
``core`` never has to import a model to build one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BatchInput:
    """One step's work, per sequence (the scheduler fills it)."""

    token_ids: list[list[int]]  # the new tokens of each sequence this step
    start_positions: list[int]  # position of each sequence's first new token
    block_tables: list[list[int]]
    prompt_lengths: list[int] | None = None  # for dynamic rotary scaling (see fdcore.checkpoint.rope)

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)
