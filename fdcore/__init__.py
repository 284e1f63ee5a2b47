"""fdcore: an LLM serving engine core built as an actor system on shared memory."""

__version__ = "0.1.0"

from fdcore.client import LLM, AsyncLLM, CompletionOutput, EngineError, RequestOutput
from fdcore.protocol import SamplingParams, StructuredOutputs

__all__ = ["AsyncLLM", "LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput", "EngineError"]
