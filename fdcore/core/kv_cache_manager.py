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
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from fdcore.protocol import CacheStats


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None



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
        self._requests: dict[str, _Allocation] = {}
        self._queried = self._hits = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_hashed_blocks(self, request_id: str) -> int:
        return self._requests[request_id].num_hashed

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._requests[request_id].blocks]

    def statistics(self) -> CacheStats:
        """The counters as the scheduler and the engine's stats report them (one type for the concept)."""
        total, free = len(self.blocks), len(self._free)
        return CacheStats(total, free, len(self._cached), (total - free) / total,
                          self._hits / self._queried if self._queried else 0.0, self._queried, self._hits)

    # ------------------------------------------------------------- allocation
    def allocate(self, request_id: str, token_ids: list[int], max_new_tokens: int,
                 reuse_prefix: bool = True) -> int | None:
        """Start a request: reuse cached prefix blocks (unless ``reuse_prefix`` is False: a request
        that scores its prompt computes all of it), then room for up to ``max_new_tokens`` more.

        Returns the number of tokens already computed (a multiple of the block
        size, at most ``len(token_ids) - 1``: the last token is always recomputed
        to get its logits), or None when there is no room (nothing is then held).
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        hits = self._cached_prefix(token_ids) if self.enable_prefix_caching and reuse_prefix else []
        num_tokens = min(len(token_ids), len(hits) * self.block_size + max_new_tokens)
        needed = self._blocks_for(num_tokens) - len(hits)
        free_after_hits = len(self._free) - sum(1 for b in hits if b.ref_count == 0)
        if needed > free_after_hits:
            return None
        allocation = self._requests[request_id] = _Allocation()
        for block in hits:
            self._take(block)
            allocation.blocks.append(block)
        allocation.num_hashed = len(hits)
        allocation.last_hash = hits[-1].block_hash if hits else None
        allocation.blocks += [self._fresh() for _ in range(max(0, needed))]
        self._queried += len(token_ids)
        self._hits += len(hits) * self.block_size
        return len(hits) * self.block_size

    def append_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` in total; False (nothing changed) when blocks run out."""
        allocation = self._requests[request_id]
        needed = self._blocks_for(num_tokens) - len(allocation.blocks)
        if needed > len(self._free):
            return False
        allocation.blocks += [self._fresh() for _ in range(max(0, needed))]
        return True

    def cache_computed(self, request_id: str, token_ids: list[int], num_computed: int,
                       first_block: int = 0) -> None:
        """Register the request's newly full, computed blocks in the prefix cache.

        ``token_ids`` may start at block ``first_block`` (at most the number of
        blocks registered already), so a remote caller sends only what is new.
        """
        if not self.enable_prefix_caching:
            return
        allocation = self._requests[request_id]
        if first_block > allocation.num_hashed:
            raise ValueError(f"request {request_id!r}: tokens start at block {first_block}, "
                             f"but only {allocation.num_hashed} blocks are registered")
        full = min(num_computed // self.block_size, len(allocation.blocks))
        for index in range(allocation.num_hashed, full):
            at = (index - first_block) * self.block_size
            tokens = tuple(token_ids[at:at + self.block_size])
            block_hash = hash((allocation.last_hash, tokens))
            block = allocation.blocks[index]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
            allocation.last_hash = block_hash
        allocation.num_hashed = max(allocation.num_hashed, full)

    def free(self, request_id: str) -> None:
        """Release a request's blocks at once (tail first into the LRU queue)."""
        allocation = self._requests.pop(request_id, None)
        if allocation is None:
            return
        for block in reversed(allocation.blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def free_all(self) -> None:
        """Release every request's blocks, as :meth:`free` would one by one: what each computed block
        cached stays in the prefix cache (a new epoch whose KV memory outlived the old one's actors)."""
        for request_id in list(self._requests):
            self.free(request_id)

    # ---------------------------------------------------------------- helpers
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cached_prefix(self, token_ids: list[int]) -> list[Block]:
        hits, parent = [], None
        usable = (len(token_ids) - 1) // self.block_size  # keep the last token to compute
        for index in range(usable):
            tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            parent = hash((parent, tokens))
            block = self._cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def _fresh(self) -> Block:
        """The least recently freed block, forgetting whatever prefix it cached."""
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block
