"""vLLM's side of bench_structured.py, run in the vLLM peer's venv: the same prompts (random token ids,
seeded as bench_throughput's), unconstrained and with ``structured_outputs`` (vLLM's own API, its
default backend), generated tokens per second, median of --repeat runs after a warm-up.
Prints one JSON line: {"unconstrained", "constrained", "backend"}."""

import argparse
import json
import random
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--schema", required=True)
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=1024, seed=0, max_num_seqs=a.prompts)
    vocab = json.load(open(f"{a.model}/config.json"))["vocab_size"]
    rng = random.Random(0)  # bench_throughput.make_prompts' prompts
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(a.input_len)]} for _ in range(a.prompts)]
    free = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=1.0, seed=0)
    held = SamplingParams(
        max_tokens=a.output_len,
        temperature=1.0,
        seed=0,
        structured_outputs=StructuredOutputsParams(json=json.loads(a.schema)),
    )
    llm.generate(prompts[:4], held, use_tqdm=False)
    rates = {"unconstrained": [], "constrained": []}
    for _ in range(a.repeat):
        for name, params in (("unconstrained", free), ("constrained", held)):
            t0 = time.time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(produced / (time.time() - t0))
            assert produced == a.prompts * a.output_len, f"{name}: {produced} tokens"
    backend = llm.llm_engine.vllm_config.structured_outputs_config.backend
    print(json.dumps({**{k: statistics.median(v) for k, v in rates.items()}, "backend": backend}))


if __name__ == "__main__":
    main()
