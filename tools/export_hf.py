"""Write a Hugging Face checkpoint directory from a GGUF file, read by fdcore's own GGUF reader.

    python tools/export_hf.py smollm2 OUT_DIR [--dtype float32|bfloat16]
    python tools/export_hf.py FILE.gguf OUT_DIR --check /tmp/refvenv/bin/python

The directory holds exactly the weights fdcore runs from the GGUF (``fdcore.checkpoint.gguf.read_gguf``:
dequantized to float32, q/k rows back in HF's rotary order), so vLLM, transformers and llama.cpp's
``convert_hf_to_gguf.py`` can load the very same model fdcore serves:

- ``config.json``: the config fdcore synthesizes from the metadata, plus ``torch_dtype``;
- ``model.safetensors``: float32 (bit-identical to fdcore's float32 weights) or bfloat16 (rounded to
  nearest even); a tied model has no ``lm_head.weight``, as transformers saves it;
- ``tokenizer.json``: fdcore's tokenizer for the file's vocabulary (``gguf_tokenizer``);
- ``tokenizer_config.json``: ``PreTrainedTokenizerFast`` with the bos / eos / unk / pad tokens, the
  chat template, ``add_bos_token`` / ``add_eos_token`` and ``model_max_length`` from the metadata;
- ``generation_config.json``: bos, eos (with the end-of-turn ids fdcore stops at), pad and the
  ``general.sampling.*`` values the file recommends, when it has any.

``--check PYTHON`` then proves it: fdcore's greedy tokens for a few chats (prompts rendered by
transformers, from tests/data/gguf_reference.json) from the GGUF and from the directory, beside
transformers' greedy tokens from the directory (run in PYTHON, which has torch + transformers,
through tools/make_gguf_reference.py's ``chat_case``); exit 1 on any difference. Only meaningful
for a float32 export (a bfloat16 one runs in bfloat16 in transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

# general.sampling.* (llama.cpp's recommended sampling, gguf-py Keys.General) -> generation_config.json
SAMPLING_KEYS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}
CHECK_CHATS = 3  # reference chats the check runs (each: up to 24 greedy tokens)


def _metadata(file: str) -> dict:
    """The tokenizer / sampling keys the exporter needs beyond what fdcore's reader returns."""
    import gguf

    fields = gguf.GGUFReader(file, "r").fields
    wanted = [
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
    ]
    wanted += [f"general.sampling.{key}" for key in SAMPLING_KEYS]
    return {key: fields[key].contents() for key in wanted if key in fields}


def export_hf(gguf_file: str, out_dir: str, dtype: str = "float32") -> str:
    """Write the HF directory for ``gguf_file`` to ``out_dir`` (atomically: complete or absent)."""
    from fdcore.checkpoint.gguf import read_gguf
    from fdcore.checkpoint.gguf_tokenizer import gguf_tokenizer
    from fdcore.checkpoint.tiny import atomic_directory, save_weights

    config, tensors, eos, _ = read_gguf(gguf_file)
    tokenizer, settings = gguf_tokenizer(gguf_file)
    meta = _metadata(gguf_file)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    names = {i: tok for tok, i in vocab.items()}

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else names.get(int(token_id))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": settings["bos_token"],
        "eos_token": settings["eos_token"],
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    tokenizer_config = {k: v for k, v in tokenizer_config.items() if v is not None}
    if settings["chat_template"]:
        tokenizer_config["chat_template"] = settings["chat_template"]
    generation = {"bos_token_id": config["bos_token_id"]} if "bos_token_id" in config else {}
    if eos:
        generation["eos_token_id"] = list(eos) if len(eos) > 1 else eos[0]
    if "tokenizer.ggml.padding_token_id" in meta:
        generation["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    for key, name in SAMPLING_KEYS.items():
        if f"general.sampling.{key}" in meta:
            generation[name] = meta[f"general.sampling.{key}"]

    with atomic_directory(out_dir, prefix=".export-hf-") as tmp:
        _write_json(os.path.join(tmp, "config.json"), {**config, "torch_dtype": dtype})
        _write_json(os.path.join(tmp, "generation_config.json"), generation)
        _write_json(os.path.join(tmp, "tokenizer_config.json"), tokenizer_config)
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        save_weights(tmp, tensors, 1, dtype)
    return out_dir


def _write_json(path: str, data) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---------------------------------------------------------------------- the check
_TRANSFORMERS = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
sys.path.insert(0, sys.argv[1])
import make_gguf_reference as ref
torch.set_num_threads(2)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32).eval()
chats = json.loads(sys.stdin.read())
print(json.dumps([ref.chat_case(tokenizer, model, messages) for messages in chats]))
"""


def _fdcore_greedy(path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from fdcore.checkpoint import load_checkpoint
    from fdcore.models.llama import LlamaModel
    from tests.models.test_model import run_greedy

    model = LlamaModel(load_checkpoint(path, progress=lambda *_: None))
    return run_greedy(model, prompts, new_tokens)


def check(gguf_file: str, out_dir: str, python: str) -> bool:
    """fdcore (GGUF), fdcore (directory) and transformers (directory) agree token for token."""
    with open(os.path.join(ROOT, "tests", "data", "gguf_reference.json"), encoding="utf-8") as f:
        reference = json.load(f)
    chats = reference["chats"][:CHECK_CHATS]
    result = subprocess.run(
        [python, "-c", _TRANSFORMERS, HERE, out_dir],
        input=json.dumps([c["messages"] for c in chats]),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        print(f"transformers failed on {out_dir}:\n{result.stderr[-3000:]}", file=sys.stderr)
        return False
    hf = json.loads(result.stdout.strip().splitlines()[-1])
    prompts = [c["prompt"] for c in chats]
    fd_gguf = _fdcore_greedy(gguf_file, prompts, reference["new_tokens"])
    fd_dir = _fdcore_greedy(out_dir, prompts, reference["new_tokens"])
    ok = True
    for chat, case, a, b in zip(chats, hf, fd_gguf, fd_dir, strict=True):
        n = len(case["output"])  # transformers stops at eos; fdcore's run does not
        same_prompt = case["prompt"] == chat["prompt"]
        same = same_prompt and case["output"] == a[:n] == b[:n]
        ok &= same
        print(f"{'same' if same else 'DIFFERENT'}: {n} greedy tokens {case['output_text']!r}")
        if not same:
            print(
                f"  chat template ids {'equal' if same_prompt else 'DIFFER'}\n  transformers {case['output']}"
                f"\n  fdcore gguf  {a[:n]}\n  fdcore dir   {b[:n]}"
            )
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", help="a GGUF file, or smollm2 (fetched once; see fdcore.checkpoint.fetch)")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--check",
        metavar="PYTHON",
        help="a python with torch + transformers: check that "
        "transformers' greedy tokens from the directory equal fdcore's",
    )
    args = parser.parse_args(argv)
    if args.gguf == "smollm2":
        from fdcore.checkpoint.fetch import fetch_smollm2

        args.gguf = fetch_smollm2()
    export_hf(args.gguf, args.out_dir, args.dtype)
    print(f"{args.out_dir}: {args.dtype} HF checkpoint of {args.gguf}")
    if args.check:
        return 0 if check(args.gguf, args.out_dir, args.check) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
