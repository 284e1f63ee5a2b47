"""The thin client: embed fdcore in any Python program (``AsyncLLM``, and the sync ``LLM``).

::

    from fdcore import AsyncLLM, SamplingParams

    async with AsyncLLM("fdcore.toml") as llm:          # starts the actor tree ...
        async for out in llm.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.outputs[0].text, end="")          # ... and streams deltas

``AsyncLLM(config)`` starts ``python -m fdcore.supervisor --config`` as a child
(it stops when the program ends, however it ends); ``AsyncLLM.connect()``
attaches to a tree that is already running. Any number of processes, up to
``engine.max_clients``, can use one tree at once: each claims a *client slot*
(an inbox the engine answers on) by locking it, so a slot is freed by the
kernel the moment its owner dies, and the engine then aborts what that owner
left running.

Streaming: each ``RequestOutput`` from ``generate`` carries the *new* tokens
and text since the previous one (FastDeploy's convention); ``LLM.generate``
returns whole outputs. A request the engine refuses ends with one output with
``finish_reason == "error"``, ``error_code`` (400, 429, ...) and ``error_msg``
naming the field and the limit; nothing is raised for it. ``LLM.generate``
never hands back a 429 (it keeps a window of requests in the engine and sends
refused ones again); ``AsyncLLM.generate(..., wait=True)`` waits for room too.

Only a client that can no longer be served raises: :class:`EngineDeadError`
from every open request and every later call, when the tree stopped, the client
was shut down or its reader thread died. An engine restart is not that: open
requests are re-submitted to the new engine and resume.
"""

from fdcore.client.async_llm import AsyncLLM
from fdcore.client.llm import LLM
from fdcore.client.outputs import CompletionOutput, EngineDeadError, EngineError, RequestOutput, chat_prompt
from fdcore.client.tree import Tree
from fdcore.protocol import PromptLogprob, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineDeadError",
    "EngineError",
    "PromptLogprob",
    "RequestOutput",
    "SamplingParams",
    "Tree",
    "chat_prompt",
]
