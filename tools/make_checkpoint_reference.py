"""transformers' greedy tokens for every checkpoint variant of tests/checkpoints.py (a developer tool).

    python -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 transformers safetensors tokenizers numpy
    /tmp/refvenv/bin/python tools/make_checkpoint_reference.py .venv/bin/python tests/data/checkpoint_reference.json

The checkpoints are written by the project's own environment (the first
argument: it has Paddle, which writes bfloat16), so the bytes transformers
reads here are the bytes the tests make. Each variant's config is also saved
back by transformers (``AutoConfig.save_pretrained``: every default key it
writes, ``layer_types``, ``rope_parameters``...) and recorded: the tests load
the weights under that config.json, as a user's checkpoint would have it. bfloat16 / float16 weights are run
upcast to float32 (``dtype=torch.float32``), the dtype fdcore computes in. A
model is loaded afresh for each prompt: transformers' dynamic rotary scaling
keeps state across calls.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW_TOKENS = 24


def prompts(tokenizer: Tokenizer) -> dict[str, list[int]]:
    long_text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    out = {
        "short": tokenizer.encode("def main():").ids,
        "medium": tokenizer.encode(long_text).ids[:116],  # crosses 128 positions while generating
        "long": tokenizer.encode(long_text).ids[:300],
    }
    assert len(out["long"]) == 300, len(out["long"])
    return out


def variants(python: str) -> list[str]:
    code = "from tests.checkpoints import VARIANTS; print(' '.join(VARIANTS))"
    return subprocess.run([python, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()


def greedy(path: str, ids: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=NEW_TOKENS,
        )
    return gen[0, len(ids) :].tolist()


def saved_config(path: str, out_dir: str) -> dict:
    """config.json as transformers writes it for this checkpoint (read, then saved back)."""
    AutoConfig.from_pretrained(path).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        return json.load(f)


def main(python: str, out_file: str) -> None:
    torch.manual_seed(0)
    result = {
        "new_tokens": NEW_TOKENS,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "variants": {},
        "configs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants(python):
            path = os.path.join(tmp, name)
            subprocess.run([python, "-m", "tests.checkpoints", path, name], cwd=ROOT, check=True, capture_output=True)
            tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
            cases = {case: {"prompt": ids, "output": greedy(path, ids)} for case, ids in prompts(tokenizer).items()}
            for case, data in cases.items():
                print(name, case, len(data["prompt"]), data["output"][:8], flush=True)
            result["variants"][name] = cases
            result["configs"][name] = saved_config(path, os.path.join(tmp, name + "-config"))
    with open(out_file, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
