"""One process's worth of serving: schedule, run the model, sample, account (vLLM's EngineCore.step).

The actors split this loop across processes (scheduler, cache manager,
workers); kept whole here it is the reference the actor tree must reproduce,
and what tests and the null-model benchmark drive directly.
"""

from __future__ import annotations

import numpy as np

from fdcore.core.batch import BatchInput
from fdcore.core.scheduler import Request, ScheduledRequest, Scheduler
from fdcore.models.sampling import SamplerRequest, sample


class EngineCore:
    def __init__(self, model, cache, scheduler: Scheduler):
        self.model = model
        self.cache = cache
        self.scheduler = scheduler

    def add(self, request: Request) -> None:
        request.params = request.params.with_defaults()  # unset parameters: fdcore's neutral defaults
        self.scheduler.add(request)

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        batch = BatchInput(
            [s.token_ids for s in scheduled], [s.start for s in scheduled], [s.block_table for s in scheduled]
        )
        logits = self.model.forward(batch, self.cache)
        return self.scheduler.update(scheduled, self._sample(scheduled, logits))

    def run(self) -> None:
        """Step until every request has finished."""
        while self.scheduler.has_work():
            self.step()

    @staticmethod
    def _sample(scheduled: list[ScheduledRequest], logits: np.ndarray) -> dict[str, int]:
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        if not rows:
            return {}
        requests = [scheduled[i].request for i in rows]
        picks = sample(
            logits[rows],
            [SamplerRequest(r.params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids) for r in requests],
        )
        return {r.request_id: p.token_id for r, p in zip(requests, picks, strict=True)}
