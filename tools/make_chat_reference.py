"""Chat-template reference renderings from Hugging Face transformers (a developer tool; its output is committed).

    /tmp/refvenv/bin/python tools/make_chat_reference.py tests/data/chat_templates.json

Small templates modelled on real ones (Qwen2.5's with tools, SmolLM2's, Llama 3.1's with and
without ``{% generation %}``, a documents template, one exercising the sandbox's extras) are
rendered by transformers' ``apply_chat_template(..., tokenize=False)`` and tokenized with it, with
the bundled tiny tokenizer; and a few checkpoint layouts (``chat_template.jinja``,
``additional_chat_templates/``, tokenizer_config.json's string or list) are loaded by
``AutoTokenizer`` to record which templates it finds. tests/checkpoint/test_chat_template.py checks fdcore's
renderer and template discovery against this file, without installing transformers. Runs without
fdcore (its own venv has no msgspec): the tokenizer file is read by path.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import transformers
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "fdcore", "checkpoint", "tiny_tokenizer.json")
# the special tokens fdcore.checkpoint.tiny writes into tokenizer_config.json
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"}

QWEN25 = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'You are Qwen, a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call functions. Their signatures are within <tools></tools>:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nAnswer a call as <tool_call>{\\"name\\": ..., \\"arguments\\": ...}</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first)
          or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_LLAMA3 = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0].role == 'assistant' %}
    {{- raise_exception("Conversations start with a system or user message") }}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|im_start|>system<|im_end|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "</s>" }}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '<|im_end|>\\n\\n' }}
    {%- if message.role == 'assistant' %}
        @@ASSISTANT@@
    {%- else %}
        {{- message.content | trim + '</s>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant<|im_end|>\\n\\n' }}
{%- endif %}
"""
LLAMA3 = _LLAMA3.replace("@@ASSISTANT@@", "{{- message.content | trim + '</s>' }}")
LLAMA3_GENERATION = _LLAMA3.replace(
    "@@ASSISTANT@@", "{% generation %}{{- message.content | trim + '</s>' }}{% endgeneration %}"
)

DOCUMENTS = (
    "{{ bos_token }}{% if documents %}<|im_start|>documents\n{% for doc in documents %}"
    "[{{ loop.index0 }}] {{ doc.title }}: {{ doc.text }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FEATURES = """\
{%- set ns = namespace(users=0, last=none) %}
{%- set roles = dict(user='U', assistant='A', system='S') %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
    {%- if m.content == 'STOP' %}{% break %}{% endif %}
    {%- if m.content == 'SKIP' %}{% continue %}{% endif %}
    {{- roles[m.role] }}|{{ m.content }}
    {%- if m.reasoning_content is defined %}|r={{ m.reasoning_content }}{% endif %}
    {%- if m.thinking is defined %}|t={{ m.thinking }}{% endif %}
    {{- '\\n' }}
{%- endfor %}
{{- 'users=' ~ ns.users ~ ' tokens=' ~ [bos_token, eos_token, unk_token, pad_token] | join(',') }}
{%- if sep_token is defined %} sep={{ sep_token }}{% endif %}
{%- if extra is defined %} extra={{ extra | tojson(sort_keys=true) }}{% endif %}
{%- if tools %} tools={{ tools | tojson(separators=(',', ':')) }}{% endif %}
{%- if add_generation_prompt %}{{ '\\nA|' }}{% endif %}
"""

TEMPLATES = {
    "qwen2.5": QWEN25,
    "smollm2": SMOLLM2,
    "llama3": LLAMA3,
    "llama3-generation": LLAMA3_GENERATION,
    "documents": DOCUMENTS,
    "features": FEATURES,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Das Wetter für einen Ort (°C)",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! Grüße aus München 🚀"}]
TURNS = CHAT + [{"role": "assistant", "content": "Hello. "}, {"role": "user", "content": "And now?"}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "c1"},
    {"role": "tool", "content": '{"wind": 3}', "tool_call_id": "c1"},
]
DOCS = [{"title": "Tiny", "text": "fdcore ships a tiny model."}, {"title": "Größe", "text": "4096 Wörter"}]
PREFIX = CHAT + [{"role": "assistant", "content": "The answer is "}]

CASES = [
    ("qwen-plain", "qwen2.5", dict(messages=CHAT, add_generation_prompt=True)),
    ("qwen-no-system", "qwen2.5", dict(messages=CHAT[1:], add_generation_prompt=False)),
    ("qwen-tools", "qwen2.5", dict(messages=CHAT, tools=[WEATHER], add_generation_prompt=True)),
    ("qwen-tool-turns", "qwen2.5", dict(messages=TOOL_TURNS, tools=[WEATHER], add_generation_prompt=True)),
    ("qwen-continue", "qwen2.5", dict(messages=PREFIX, add_generation_prompt=False, continue_final_message=True)),
    ("smollm2", "smollm2", dict(messages=CHAT[1:], add_generation_prompt=True)),
    ("smollm2-turns", "smollm2", dict(messages=TURNS)),
    ("smollm2-continue", "smollm2", dict(messages=PREFIX, add_generation_prompt=False, continue_final_message=True)),
    ("llama3", "llama3", dict(messages=TURNS, date_string="01 Dec 2026")),
    (
        "llama3-tools",
        "llama3",
        dict(messages=CHAT, tools=[WEATHER], add_generation_prompt=True, date_string="01 Dec 2026"),
    ),
    ("llama3-generation", "llama3-generation", dict(messages=TURNS, date_string="01 Dec 2026")),
    (
        "llama3-generation-continue",
        "llama3-generation",
        dict(messages=PREFIX, add_generation_prompt=False, continue_final_message=True, date_string="01 Dec 2026"),
    ),
    ("llama3-raises", "llama3", dict(messages=[{"role": "assistant", "content": "x"}], date_string="x")),
    ("documents", "documents", dict(messages=CHAT[1:], documents=DOCS, add_generation_prompt=True)),
    (
        "features",
        "features",
        dict(
            messages=[
                *TURNS,
                {"role": "user", "content": "SKIP"},
                {"role": "assistant", "content": "ok", "reasoning_content": "thought"},
                {"role": "user", "content": "STOP"},
                {"role": "user", "content": "never"},
            ],
            tools=[WEATHER],
            add_generation_prompt=True,
            extra={"zeta": [1, "ü"], "alpha": None},
        ),
    ),
    ("features-no-prompt", "features", dict(messages=CHAT, add_generation_prompt=False)),
]

# Checkpoint layouts: which templates AutoTokenizer finds. A value is a file's text; "tokenizer_config"
# is the chat_template entry of tokenizer_config.json.
LAYOUTS = {
    "tokenizer-config-string": {"tokenizer_config": SMOLLM2},
    "jinja-file-wins": {"chat_template.jinja": QWEN25, "tokenizer_config": SMOLLM2},
    "tokenizer-config-list": {
        "tokenizer_config": [{"name": "default", "template": SMOLLM2}, {"name": "tool_use", "template": QWEN25}]
    },
    "jinja-and-additional": {
        "chat_template.jinja": SMOLLM2,
        "additional_chat_templates/tool_use.jinja": QWEN25,
        "additional_chat_templates/rag.jinja": DOCUMENTS,
    },
    "additional-only": {"additional_chat_templates/tool_use.jinja": QWEN25, "tokenizer_config": SMOLLM2},
}
NAMED = [  # a list-of-templates checkpoint: which one transformers picks
    ("named-default", dict(messages=CHAT[1:])),
    ("named-tools", dict(messages=CHAT[1:], tools=[WEATHER])),
    ("named-empty-tools", dict(messages=CHAT[1:], tools=[])),
    ("named-by-name", dict(messages=CHAT[1:], chat_template="tool_use")),
    ("named-default-by-name", dict(messages=CHAT[1:], tools=[WEATHER], chat_template="default")),
]


def write_layout(directory: str, files: dict) -> None:
    shutil.copyfile(TOKENIZER, os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIAL}
    for name, text in files.items():
        if name == "tokenizer_config":
            config["chat_template"] = text
            continue
        os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(text)
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False)


def render(tokenizer, args: dict) -> dict:
    args = dict(args)
    messages = args.pop("messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **args)
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **args)
    except Exception as exc:  # the case is an expected failure
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"text": text, "token_ids": list(ids)}


def main(out_file: str) -> None:
    result = {
        "transformers": transformers.__version__,
        "special_tokens": SPECIAL,
        "templates": TEMPLATES,
        "cases": [],
        "layouts": {},
        "named": [],
    }
    with tempfile.TemporaryDirectory() as root:
        for name, template, args in CASES:
            directory = os.path.join(root, name)
            os.makedirs(directory)
            write_layout(directory, {"tokenizer_config": TEMPLATES[template]})
            tokenizer = AutoTokenizer.from_pretrained(directory)
            result["cases"].append({"name": name, "template": template, "args": args, **render(tokenizer, args)})
        for name, files in LAYOUTS.items():
            directory = os.path.join(root, "layout-" + name)
            os.makedirs(directory)
            write_layout(directory, files)
            found = AutoTokenizer.from_pretrained(directory).chat_template
            result["layouts"][name] = {
                "files": files,
                "found": found if isinstance(found, dict) else {"default": found},
            }
        directory = os.path.join(root, "named")
        os.makedirs(directory)
        write_layout(directory, LAYOUTS["tokenizer-config-list"])
        tokenizer = AutoTokenizer.from_pretrained(directory)
        for name, args in NAMED:
            result["named"].append({"name": name, "args": args, **render(tokenizer, args)})
    with open(out_file, "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False, indent=1)
        f.write("\n")
    failed = [c["name"] for c in result["cases"] if "error" in c]
    print(
        f"wrote {len(result['cases'])} cases ({len(failed)} expected failures: {failed}), "
        f"{len(result['layouts'])} layouts, {len(result['named'])} named to {out_file}"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "chat_templates.json"))
