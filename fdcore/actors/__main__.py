"""Entry point of every actor process: ``python -m fdcore.actors KIND ...``."""

import importlib
import sys

from fdcore.actors.runtime import main
from fdcore.actors.topology import KINDS


def actor_class(kind: str):
    if kind not in KINDS:
        raise SystemExit(f"unknown actor kind {kind!r}; known: {', '.join(KINDS)}")
    module, _, name = KINDS[kind].actor_class.partition(":")
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    sys.exit(main(actor_class(sys.argv[1])))
