"""Write fdcore/checkpoint/transformers_config_keys.txt: every config key some transformers model class reads (the
attributes its configuration classes set by default, and their __init__ parameters), so that the loader can tell a
key no transformers model reads (a warning) from one that changes some model's maths (an error unless fdcore
implements it or knows it changes nothing).

Run with a python that has transformers (the vLLM peer's):
    /tmp/vllm-peer/venv/bin/python tools/transformers_config_keys.py
"""

from __future__ import annotations

import inspect
import os
import sys

OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "fdcore", "checkpoint", "transformers_config_keys.txt"
)


def main() -> int:
    import transformers
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    base = set(PretrainedConfig().to_dict())
    keys: set[str] = set()
    for name in list(CONFIG_MAPPING.keys()):
        try:
            cls = CONFIG_MAPPING[name]
        except Exception:  # (a model whose dependency is missing)
            continue
        try:
            keys |= set(cls().to_dict())
        except Exception:
            pass
        for klass in cls.__mro__:
            if klass is PretrainedConfig or not issubclass(klass, PretrainedConfig):
                continue
            try:
                keys |= {p for p in inspect.signature(klass.__init__).parameters if p not in ("self", "kwargs")}
            except (TypeError, ValueError):
                pass
    keys -= base  # (PretrainedConfig's own: bookkeeping and generation settings, listed in model_args.IGNORED)
    with open(OUT, "w") as f:
        f.write(
            f"# config keys transformers {transformers.__version__} model classes read "
            "(tools/transformers_config_keys.py)\n"
        )
        f.write("\n".join(sorted(keys)) + "\n")
    print(f"{len(keys)} keys -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
