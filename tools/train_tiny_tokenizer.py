"""Train the bundled tiny model's tokenizer (run once by a developer; the output is committed).

    python tools/train_tiny_tokenizer.py fdcore/checkpoint/tiny_tokenizer.json

A byte-level BPE of 4096 tokens trained on the standard library's Python sources
plus a few lines of non-ASCII text, so that any text (any UTF-8 byte) encodes.
The result is shipped in the package rather than trained at install time,
because a machine's standard library differs between Python versions and the
tiny model must come out byte-identical everywhere.
"""

import glob
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
EXTRA = ["Grüße aus München, ça va? Señor niño.", "日本語のテキストと中文文本。", "Привет, мир! Γειά σου κόσμε."]


def corpus():
    stdlib = os.path.dirname(os.__file__)
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()
    yield from EXTRA * 50


def main(out: str) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    tokenizer.save(out)
    print(f"{out}: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main(sys.argv[1])
