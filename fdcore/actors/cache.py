"""The cache manager actor (fdcore:cache): the paged block allocator and the prefix cache.

It owns the block bookkeeping (:class:`~fdcore.core.kv_cache_manager.KVCacheManager`:
reference counts, chained block hashes, LRU of freed cached blocks); the KV
tensors themselves live in the workers. The scheduler is its only client: its
block calls arrive in order on one link, so the allocator sees exactly the call
sequence an in-process scheduler would make (same blocks, same prefix hits).
Calls that need an answer get a :class:`CacheReply` carrying the statistics.
"""

from __future__ import annotations

from fdcore.actors import faults
from fdcore.actors.runtime import Actor
from fdcore.core.kv_cache_manager import KVCacheManager
from fdcore.protocol import (
    Allocate,
    CacheMessage,
    CacheReply,
    CacheReset,
    CacheStatsQuery,
    Computed,
    Free,
    Grow,
    GrowMany,
    GrowReply,
    Ping,
    Stop,
)


class CacheActor(Actor):
    inbox_type = CacheMessage
    suspects_to = "scheduler"  # it forwards the report to the engine

    def on_start(self) -> None:
        # read once: the checkpoint's config (a GGUF file's whole metadata, its vocabulary among it: ~0.13 s on
        # SmolLM2) is no part of a reset, which the first request and every restart's resume wait for
        self.prefix_caching = self.config.cache.enable_prefix_caching and prefix_caching_is_exact(self.config)
        self.kv = self._fresh_manager()
        self.epoch: int | None = None  # nothing is served before the scheduler's first CacheReset
        self.poison = faults.poison_for("cache")

    def _fresh_manager(self) -> KVCacheManager:
        c = self.config.cache
        return KVCacheManager(c.num_blocks, c.block_size, self.prefix_caching)

    def handle(self, message) -> None:
        if self.epoch is None and not isinstance(message, (CacheReset, Stop, Ping)):
            return  # a call of a scheduler (or an epoch) that is gone
        match message:
            case Allocate(seq=seq, token_ids=token_ids, max_new_tokens=max_new, reuse_prefix=reuse):
                self.handling = [seq]
                faults.check(self.poison, seq, token_ids)
                cached = self.kv.allocate(seq, token_ids, max_new, reuse)
                blocks = self.kv.block_table(seq) if cached is not None else []
                self._reply(seq, cached is not None, blocks, -1 if cached is None else cached)
            case Grow(seq=seq, num_tokens=num_tokens):
                self.handling = [seq]
                ok = self.kv.append_slots(seq, num_tokens)
                self._reply(seq, ok, self.kv.block_table(seq), 0)
            case GrowMany(seqs=seqs, num_tokens=targets):
                self.handling = list(seqs)
                tables = []
                for seq, num_tokens in zip(seqs, targets, strict=True):
                    if not self.kv.append_slots(seq, num_tokens):
                        break
                    tables.append(self.kv.block_table(seq))
                self.send("scheduler", GrowReply(len(tables), tables, self.kv.statistics(), self.epoch))
            case Free(seq=seq):
                self.kv.free(seq)
            case Computed(seq=seq, first_block=first, token_ids=token_ids, num_computed=num):
                self.kv.cache_computed(seq, token_ids, num, first)
            case CacheStatsQuery(nonce=nonce):
                self._reply(nonce, True, [], 0)
            case CacheReset(epoch=epoch, keep_prefixes=keep, tails=tails):
                if keep:
                    self.kv.free_all(tails)
                else:
                    self.kv = self._fresh_manager()
                self.epoch = epoch
            case _:
                super().handle(message)

    def _reply(self, seq: int, ok: bool, blocks: list[int], cached: int) -> None:
        self.send("scheduler", CacheReply(seq, ok, blocks, cached, self.kv.statistics(), self.epoch))


def prefix_caching_is_exact(config) -> bool:
    """False for a model with dynamic rotary scaling: a key's rotation there depends on the length
    of the prompt it came with (see fdcore.checkpoint.rope), so another prompt sharing its first blocks
    must not reuse them. (A missing or unreadable checkpoint is the worker's to report.)"""
    if config.model.backend == "null":
        return True
    from fdcore.checkpoint import CheckpointError, ModelArgs, read_config
    from fdcore.config import model_path

    path = model_path(config)
    try:
        return not ModelArgs.from_config(read_config(path), path).rope.is_dynamic
    except CheckpointError:
        return True
