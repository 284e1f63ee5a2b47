"""Write tests/data/vllm_request_fields.json: every field vLLM accepts on /v1/completions and
/v1/chat/completions, with its default (null where it has none that JSON can hold), read from
vLLM's own request models. Run with the vLLM peer's python:

    /tmp/vllm-peer/venv/bin/python tools/vllm_request_fields.py tests/data/vllm_request_fields.json
"""

import json
import sys


def fields(model) -> dict:
    out = {}
    for name, info in model.model_fields.items():
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        try:
            json.dumps(default)
        except (TypeError, ValueError):
            default = None
        out[info.alias or name] = default
    return dict(sorted(out.items()))


def main() -> None:
    import vllm
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    table = {
        "vllm": vllm.__version__,
        "/v1/completions": fields(CompletionRequest),
        "/v1/chat/completions": fields(ChatCompletionRequest),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
