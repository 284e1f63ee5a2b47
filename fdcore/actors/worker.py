"""The worker actor (fdcore:worker:N): owns the model and the KV cache of one device.

Ready means the checkpoint is loaded: config checked, every tensor read and
shape-checked, the model built and the KV cache allocated. Loading reports its
progress on the health board (and as a bar on stderr); a bad checkpoint is a
start-up crash whose message names the file, which the supervisor reports
instead of retrying.
"""

from __future__ import annotations

import sys

from fdcore.actors import health
from fdcore.actors.runtime import Actor
from fdcore.config import model_path


class WorkerActor(Actor):
    def on_start(self) -> None:
        from fdcore.models.llama import LlamaModel, PagedKVCache
        from fdcore.models.loader import load_checkpoint

        checkpoint = load_checkpoint(model_path(self.config), progress=self._loading)
        dtype = "float32" if self.config.model.dtype == "auto" else self.config.model.dtype
        self.model = LlamaModel(checkpoint, dtype)
        self.eos_token_ids = checkpoint.eos_token_ids
        cache = self.config.cache
        self.cache = PagedKVCache(checkpoint.args, cache.num_blocks, cache.block_size)

    def _loading(self, done: int, total: int) -> None:
        self.board.write(self.slot, health.LOADING, 1000 * done // total)
        sys.stderr.write(f"{self.child_id}: loading weights {done}/{total} files\n")
