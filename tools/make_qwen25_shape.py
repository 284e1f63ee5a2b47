"""Write a random-weight checkpoint with Qwen2.5-0.5B's shape, as transformers saves it (issue 15 item 5:
a real-size model whose weights nobody has to download).

    /tmp/vllm-peer/venv/bin/python tools/make_qwen25_shape.py OUT_DIR

Run it with a python that has torch + transformers (the vLLM peer's venv). The architecture is
Qwen2.5-0.5B-Instruct's published config.json (24 layers, hidden 896, 14 query / 2 KV heads of 64,
MLP 4864, vocabulary 151,936, tied embeddings, q/k/v biases, rope theta 1e6), initialised by
transformers (normal, std = initializer_range) and saved in bfloat16 as the real one is (~1 GB).
The tokenizer is a word-level vocabulary of the same size (``t0`` .. ``t151935``, split on spaces):
benchmarks feed token ids, and the servers only need every id to decode to something.
Deterministic: seed 0.
"""

from __future__ import annotations

import json
import os
import sys

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu",
                  initializer_range=0.02, bos_token_id=151643, eos_token_id=151645,
                  use_sliding_window=False, sliding_window=32768, max_window_layers=21)


def write_tokenizer(out: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": None,
                   "eos_token": f"t{QWEN25_05B['eos_token_id']}", "model_max_length": 32768}, f, indent=1)


def main(argv: list[str]) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = argv[0]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_05B, torch_dtype="bfloat16")
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, config.vocab_size)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, bfloat16")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
