"""Paged KV-cache blocks with reference counts and prefix caching (the cache manager's policy).

Pure bookkeeping: block ids only, no tensors (those live in the workers).

- A request's blocks are listed in its block table; a block shared by several
  requests (a common prefix) has one reference per request.
- Prefix caching: a *full* block is identified by a chained hash,
  ``hash((hash of the previous block, its token ids))``, so equal hashes mean
  equal prefixes. A new request takes the longest run of cached blocks that
  matches its prompt and computes only the rest.
- Freed blocks keep their hash and wait in an LRU queue: they can still be hit
  until they are reused for something else (least recently freed first, and a
  request's tail blocks before its head, since heads are shared more often).
- Resumed tails (:meth:`free_all` with ``tails``): where the KV memory outlives a
  restart, each request's last, partly filled block is kept too, under its parent
  hash and the tokens it holds, so that the same request re-sent finds all of its
  computed tokens. Such a block is taken by one request only (its next positions are
  about to be written), and is forgotten when taken or reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from fdcore.protocol import CacheStats


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    tail_key: tuple[Any, ...] | None = None  # (parent hash, the tokens it holds): a resumable partial block (free_all)


@dataclass
class _Allocation:
    blocks: list[Block] = field(default_factory=list)
    num_hashed: int = 0  # leading blocks already registered in the prefix cache
    last_hash: int | None = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}
        self._tails: dict[tuple[Any, ...], Block] = {}  # tail_key -> a free, partly filled block (free_all)
        self._requests: dict[str | int, _Allocation] = {}
        self._queried = self._hits = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_hashed_blocks(self, request_id: str | int) -> int:
        return self._requests[request_id].num_hashed

    def block_table(self, request_id: str | int) -> list[int]:
        return [b.block_id for b in self._requests[request_id].blocks]

    def statistics(self) -> CacheStats:
        """The counters as the scheduler and the engine's stats report them (one type for the concept)."""
        total, free = len(self.blocks), len(self._free)
        return CacheStats(
            total,
            free,
            len(self._cached),
            (total - free) / total,
            self._hits / self._queried if self._queried else 0.0,
            self._queried,
            self._hits,
        )

    # ------------------------------------------------------------- allocation
    def allocate(
        self, request_id: str | int, token_ids: list[int], max_new_tokens: int, reuse_prefix: bool = True
    ) -> int | None:
        """Start a request: reuse cached prefix blocks (unless ``reuse_prefix`` is False: a request
        that scores its prompt computes all of it), then room for up to ``max_new_tokens`` more.

        Returns the number of tokens already computed (at most ``len(token_ids) - 1``:
        the last token is always recomputed to get its logits): a multiple of the block
        size, plus a resumed tail's tokens where one matches; None when there is no room
        (nothing is then held).
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        use_cache = self.enable_prefix_caching and reuse_prefix
        hits = self._cached_prefix(token_ids) if use_cache else []
        parent = hits[-1].block_hash if hits else None
        tail, tail_tokens = self._resumable_tail(token_ids, len(hits), parent) if use_cache else (None, 0)
        cached = len(hits) * self.block_size + tail_tokens
        num_tokens = min(len(token_ids), cached + max_new_tokens)
        needed = self._blocks_for(num_tokens) - len(hits) - (tail is not None)
        free_after_hits = len(self._free) - sum(1 for b in hits if b.ref_count == 0) - (tail is not None)
        if needed > free_after_hits:
            return None
        allocation = self._requests[request_id] = _Allocation()
        for block in hits:
            self._take(block)
            allocation.blocks.append(block)
        if tail is not None:  # ours alone from now: its next positions are written
            del self._tails[cast(tuple[Any, ...], tail.tail_key)]
            tail.tail_key = None
            self._take(tail)
            allocation.blocks.append(tail)
        allocation.num_hashed = len(hits)
        allocation.last_hash = parent
        allocation.blocks += [self._fresh() for _ in range(max(0, needed))]
        self._queried += len(token_ids)
        self._hits += cached
        return cached

    def append_slots(self, request_id: str | int, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` in total; False (nothing changed) when blocks run out."""
        allocation = self._requests[request_id]
        needed = self._blocks_for(num_tokens) - len(allocation.blocks)
        if needed > len(self._free):
            return False
        allocation.blocks += [self._fresh() for _ in range(max(0, needed))]
        return True

    def cache_computed(
        self, request_id: str | int, token_ids: list[int], num_computed: int, first_block: int = 0
    ) -> None:
        """Register the request's newly full, computed blocks in the prefix cache.

        ``token_ids`` may start at block ``first_block`` (at most the number of
        blocks registered already), so a remote caller sends only what is new.
        """
        if not self.enable_prefix_caching:
            return
        allocation = self._requests[request_id]
        if first_block > allocation.num_hashed:
            raise ValueError(
                f"request {request_id!r}: tokens start at block {first_block}, "
                f"but only {allocation.num_hashed} blocks are registered"
            )
        full = min(num_computed // self.block_size, len(allocation.blocks))
        for index in range(allocation.num_hashed, full):
            at = (index - first_block) * self.block_size
            tokens = tuple(token_ids[at : at + self.block_size])
            block_hash = hash((allocation.last_hash, tokens))
            block = allocation.blocks[index]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
            allocation.last_hash = block_hash
        allocation.num_hashed = max(allocation.num_hashed, full)

    def free(self, request_id: str | int) -> None:
        """Release a request's blocks at once (tail first into the LRU queue)."""
        allocation = self._requests.pop(request_id, None)
        if allocation is None:
            return
        for block in reversed(allocation.blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def free_all(self, tails: Iterable[tuple[str | int, int, Iterable[int]]] = ()) -> None:
        """Release every request's blocks, as :meth:`free` would one by one: what each computed block
        cached stays in the prefix cache (a new epoch whose KV memory outlived the old one's actors).
        ``tails``: (request id, tokens computed, the tokens of its last, partly filled block) for requests
        whose computed tokens end inside a block; each such block is kept for the same tokens re-sent."""
        if self.enable_prefix_caching:
            for request_id, computed, tokens in tails:
                self._keep_tail(request_id, computed, tuple(tokens))
        for request_id in list(self._requests):
            self.free(request_id)

    def _keep_tail(self, request_id: str | int, computed: int, tokens: tuple[int, ...]) -> None:
        allocation = self._requests.get(request_id)
        index, held = divmod(computed, self.block_size)
        if (
            allocation is None
            or not held
            or len(tokens) != held
            or index >= len(allocation.blocks)
            or allocation.num_hashed != index
        ):  # (its full blocks must all be registered: the parent)
            return
        block, key = allocation.blocks[index], (allocation.last_hash, tokens)
        if block.ref_count != 1 or block.block_hash is not None or key in self._tails:  # (shared; full; a twin's)
            return
        block.tail_key = key
        self._tails[block.tail_key] = block

    # ---------------------------------------------------------------- helpers
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cached_prefix(self, token_ids: list[int]) -> list[Block]:
        hits, parent = [], None
        usable = (len(token_ids) - 1) // self.block_size  # keep the last token to compute
        for index in range(usable):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent = hash((parent, tokens))
            block = self._cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def _resumable_tail(self, token_ids: list[int], index: int, parent: int | None) -> tuple[Block | None, int]:
        """A kept tail (free_all) that holds the tokens after block ``index`` (the longest), free: (block,
        tokens of it that count as computed: all it holds, short of the request's last token, which is
        computed again for its logits, over the same values), else (None, 0)."""
        if not self._tails:
            return None, 0
        start = index * self.block_size
        for held in range(min(self.block_size - 1, len(token_ids) - start), 0, -1):
            block = self._tails.get((parent, tuple(token_ids[start : start + held])))
            if block is not None and block.ref_count == 0:
                return block, min(held, len(token_ids) - 1 - start)
        return None, 0

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def _fresh(self) -> Block:
        """The least recently freed block, forgetting whatever prefix it cached."""
        _, block = self._free.popitem(last=False)
        if block.tail_key is not None:
            del self._tails[block.tail_key]  # (only a block in _tails has a key: see _keep_tail)
            block.tail_key = None
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block
