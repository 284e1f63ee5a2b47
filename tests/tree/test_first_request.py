"""The first request after start-up pays nothing the later ones do not: what the engine and the cache
manager need per request is made in their start-up, not on first use."""

from __future__ import annotations

import pytest

from fdcore.actors import cache as cache_module
from fdcore.actors.cache import CacheActor
from fdcore.actors.engine import EngineActor
from fdcore.checkpoint import tiny
from fdcore.config import parse_config
from fdcore.core import detokenizer
from fdcore.protocol import CacheReset

pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tiny.make_tiny_model(str(tmp_path_factory.mktemp("first") / "tiny"))
    return parse_config(f'[model]\npath = "{path}"\n')


class _Board:
    """The health words an actor reads (the restart generation) and writes (its load's progress)."""

    def read(self, slot: int, word: int) -> int:
        return 0

    def write(self, slot: int, word: int, value: int) -> None:
        pass


def test_the_engine_makes_its_detokenizer_table_at_start(config):
    """A byte-level vocabulary's table of token bytes (~0.35 s for SmolLM2's 49,152 tokens) is made while
    the engine starts, not in the first request's time to first token."""
    engine = EngineActor("engine", "test", config, _Board(), 0)
    engine.send = lambda *message: None
    detokenizer._tables.clear()
    engine.on_start()
    assert id(engine.tokenizer.tokenizer) in detokenizer._tables


def test_a_cache_reset_does_not_read_the_checkpoint(config, monkeypatch):
    """The scheduler's first CacheReset comes just before the first request (and after every restart):
    whether prefix caching is exact is read from the checkpoint once, at start (a GGUF file's metadata
    took ~0.13 s of SmolLM2's first request)."""
    reads = []
    real = cache_module.prefix_caching_is_exact
    monkeypatch.setattr(cache_module, "prefix_caching_is_exact", lambda c: reads.append(1) or real(c))
    actor = CacheActor("cache", "test", config, _Board(), 0)
    actor.on_start()
    for epoch in (1, 2, 3):
        actor.handle(CacheReset(epoch))
    assert len(reads) == 1
    assert actor.kv.enable_prefix_caching is True


def test_the_worker_runs_a_prompt_and_decode_steps_before_it_is_ready(config, monkeypatch):
    """The first forward passes pay one-time costs (OpenMP's threads, operators' first calls: ~0.7 s of
    SmolLM2's first time to first token): the worker pays them in its start-up, on a prompt and then
    one-token steps, in block 0 of its own new cache."""
    from fdcore.actors.worker import WorkerActor
    from fdcore.models.llama import LlamaModel

    passes = []
    real = LlamaModel.forward
    monkeypatch.setattr(
        LlamaModel,
        "forward",
        lambda self, batch, cache: (
            passes.append(([len(t) for t in batch.token_ids], batch.block_tables)) or real(self, batch, cache)
        ),
    )
    worker = WorkerActor("worker0", "test", config, _Board(), 1)
    worker.on_start()
    try:
        assert passes[0][0][0] > 1 and passes[1:] and all(rows == [1] for rows, _ in passes[1:]), passes
        assert all(tables == [[0]] for _, tables in passes)
    finally:
        worker.masks.shutdown()
