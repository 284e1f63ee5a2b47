"""The worker actor (fdcore:worker:N): owns the model and the KV cache of one device.

Ready means the checkpoint is loaded; for now that is the checkpoint directory
and its config.json read and checked (model execution lands with the model worker).
"""

import json
import os

from fdcore.actors.runtime import Actor
from fdcore.config import model_path


class WorkerActor(Actor):
    def on_start(self) -> None:
        path = model_path(self.config)
        config_file = os.path.join(path, "config.json")
        try:
            with open(config_file, "rb") as f:
                self.model_config = json.load(f)
        except OSError as exc:
            raise RuntimeError(f"{self.child_id}: cannot read {config_file}: {exc.strerror}") from None
        except ValueError as exc:
            raise RuntimeError(f"{self.child_id}: {config_file} is not valid JSON: {exc}") from None
