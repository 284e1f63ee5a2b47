"""fdcore: an LLM serving engine core built as an actor system on shared memory."""

__version__ = "0.1.0"
