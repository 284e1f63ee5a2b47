"""Write a random-weight checkpoint with Qwen2.5-0.5B's shape (or 1.5B's), as transformers saves it (issue 15
item 5: a real-size model whose weights nobody has to download).

    /tmp/vllm-peer/venv/bin/python tools/make_qwen25_shape.py OUT_DIR [--size 1.5b] [--tokenizer HF_DIR] [--arch llama]

Run it with a python that has torch + transformers (the vLLM peer's venv). The architecture is
Qwen2.5-0.5B-Instruct's published config.json (24 layers, hidden 896, 14 query / 2 KV heads of 64,
MLP 4864, vocabulary 151,936, tied embeddings, q/k/v biases, rope theta 1e6), initialised by
transformers (normal, std = initializer_range) and saved in bfloat16 as the real one is (~1 GB).
The tokenizer is a word-level vocabulary of the same size (``t0`` .. ``t151935``, split on spaces):
benchmarks feed token ids, and the servers only need every id to decode to something. llama.cpp's
converter refuses a tokenizer it does not know, so ``--tokenizer HF_DIR`` copies a real one instead
(SmolLM2's, from ``tools/export_hf.py``), and the vocabulary is then the tokenizer's (the layers keep
the shape; the embedding and LM head shrink to it). ``--size 1.5b``: Qwen2.5-1.5B-Instruct's config (28 layers,
hidden 1536, 12 query / 2 KV heads
of 128, MLP 8960, tied embeddings), ~3.1 GB. Deterministic: seed 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    initializer_range=0.02,
    bos_token_id=151643,
    eos_token_id=151645,
    use_sliding_window=False,
    sliding_window=32768,
    max_window_layers=21,
)
QWEN25_15B = {
    **QWEN25_05B,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_window_layers": 21,
}


def write_tokenizer(out: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "t0",
                "bos_token": None,
                "eos_token": f"t{QWEN25_05B['eos_token_id']}",
                "model_max_length": 32768,
            },
            f,
            indent=1,
        )


def tokenizer_ids(hf_dir: str) -> dict:
    """vocab_size, bos_token_id and eos_token_id of the tokenizer in ``hf_dir``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        special = json.load(f)

    def token_id(name):
        token = special.get(name)
        return tokenizer.token_to_id(token if isinstance(token, str) else (token or {}).get("content", ""))

    return {
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": token_id("bos_token"),
        "eos_token_id": token_id("eos_token"),
    }


def main(argv: list[str]) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--size", default="0.5b", choices=["0.5b", "1.5b"])
    parser.add_argument("--tokenizer", help="an HF directory whose tokenizer files to copy")
    parser.add_argument(
        "--arch",
        default="qwen2",
        choices=["qwen2", "llama"],
        help="llama: the same shape as a Llama (no q/k/v biases), which llama.cpp's converter "
        "takes with a tokenizer it recognizes by name only for a Qwen2",
    )
    args = parser.parse_args(argv)
    out = args.out
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    shape = dict(QWEN25_15B if args.size == "1.5b" else QWEN25_05B)
    if args.tokenizer:  # its vocabulary: every id the model can emit decodes, in every server
        shape.update(tokenizer_ids(args.tokenizer))
    if args.arch == "llama":
        shape = {
            k: v for k, v in shape.items() if k not in ("use_sliding_window", "sliding_window", "max_window_layers")
        }
        config = LlamaConfig(**shape, torch_dtype="bfloat16")
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    else:
        config = Qwen2Config(**shape, torch_dtype="bfloat16")
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    if args.tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(args.tokenizer, name), out)
    else:
        write_tokenizer(out, config.vocab_size)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, bfloat16")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
