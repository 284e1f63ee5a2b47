"""fdcore: an LLM serving engine core built as an actor system on shared memory."""

__version__ = "0.1.0"

from fdcore.client import LLM, AsyncLLM, CompletionOutput, EngineError, RequestOutput  # noqa: E402
from fdcore.protocol import SamplingParams, StructuredOutputs  # noqa: E402

__all__ = ["AsyncLLM", "LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput", "EngineError"]
