"""Greedy reference outputs from Hugging Face transformers (a developer tool; its output is committed).

    python -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 transformers safetensors tokenizers numpy
    PYTHONPATH=. /tmp/refvenv/bin/python tools/make_reference.py tests/data/reference.json

Makes the test checkpoints with fdcore.checkpoint.tiny (a Llama with GQA, a Qwen2 with
q/k/v biases and tied embeddings, the Llama split into 3 shards), runs
transformers' greedy generation on short, long (> 512 tokens) and non-ASCII
prompts in float32 on the CPU, and writes prompts and outputs as JSON, so CI
compares against them without installing torch.
"""

import json
import sys
import tempfile

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from fdcore.checkpoint import tiny

NEW_TOKENS = 24
CHECKPOINTS = {"llama-gqa": {}, "qwen2-bias-tied": {"arch": "qwen2"}, "llama-sharded": {"shards": 3}}


def prompts(tokenizer: Tokenizer) -> dict[str, list[int]]:
    long_text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    out = {
        "short": tokenizer.encode("def main():").ids,
        "non_ascii": tokenizer.encode("Grüße aus München! 日本語のテキスト 🚀 Привет").ids,
        "long": tokenizer.encode(long_text).ids,
    }
    assert len(out["long"]) > 512, len(out["long"])
    return out


def main(out_file: str) -> None:
    torch.manual_seed(0)
    result = {
        "new_tokens": NEW_TOKENS,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "checkpoints": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in CHECKPOINTS.items():
            path = tiny.make_tiny_model(f"{tmp}/{name}", **options)
            tokenizer = Tokenizer.from_file(f"{path}/tokenizer.json")
            model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
            cases = {}
            for case, ids in prompts(tokenizer).items():
                with torch.no_grad():
                    gen = model.generate(
                        torch.tensor([ids]),
                        max_new_tokens=NEW_TOKENS,
                        do_sample=False,
                        eos_token_id=None,
                        pad_token_id=0,
                        min_new_tokens=NEW_TOKENS,
                    )
                cases[case] = {"prompt": ids, "output": gen[0, len(ids) :].tolist()}
                print(name, case, len(ids), cases[case]["output"][:8], flush=True)
            result["checkpoints"][name] = {
                "options": options,
                "digest": tiny.digest(path) if options.get("shards", 1) == 1 else None,
                "cases": cases,
            }
    with open(out_file, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
