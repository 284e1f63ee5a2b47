"""Block allocation, reference counts, prefix caching with LRU eviction, statistics."""

from __future__ import annotations

import pytest

from fdcore.core.kv_cache_manager import KVCacheManager

B = 4  # block size


def test_allocation_counts_blocks_and_free_returns_them_at_once():
    kv = KVCacheManager(num_blocks=10, block_size=B)
    assert kv.allocate("a", list(range(9)), max_new_tokens=100) == 0
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 7
    assert kv.append_slots("a", 13) and len(kv.block_table("a")) == 4
    kv.free("a")
    assert kv.num_free_blocks == 10 and kv.statistics().num_free == 10


def test_no_room_means_none_and_nothing_held():
    kv = KVCacheManager(num_blocks=2, block_size=B)
    assert kv.allocate("a", list(range(12)), max_new_tokens=12) is None
    assert kv.num_free_blocks == 2
    assert kv.allocate("b", list(range(8)), max_new_tokens=8) == 0
    assert not kv.append_slots("b", 9) and len(kv.block_table("b")) == 2


def test_a_shared_prefix_is_hit_and_shared_by_reference():
    kv = KVCacheManager(num_blocks=10, block_size=B)
    prompt = list(range(10))
    kv.allocate("a", prompt, 100)
    kv.cache_computed("a", prompt, 10)  # two full blocks computed
    assert kv.allocate("b", prompt[:8] + [99, 98], 100) == 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.blocks[kv.block_table("a")[0]].ref_count == 2
    stats = kv.statistics()
    assert stats.hit_tokens == 8 and stats.hit_rate == pytest.approx(8 / 20)


def test_the_last_prompt_token_is_always_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=B)
    prompt = list(range(8))
    kv.allocate("a", prompt, 100)
    kv.cache_computed("a", prompt, 8)
    assert kv.allocate("b", prompt, 100) == 4  # not 8: the logits of token 7 are needed


def test_freed_blocks_stay_hittable_until_reused_least_recent_first():
    kv = KVCacheManager(num_blocks=4, block_size=B)
    first = list(range(9))
    kv.allocate("a", first, 100)
    kv.cache_computed("a", first, 9)
    kv.free("a")
    assert kv.statistics().num_cached == 2
    assert kv.allocate("b", first, 100) == 8  # still cached after free
    kv.free("b")
    kv.allocate("c", [50] * 16, 16)  # needs all 4 blocks: evicts the cached ones
    assert kv.statistics().num_cached == 0
    kv.free("c")
    assert kv.allocate("d", first, 100) == 0


def test_prefix_caching_can_be_switched_off():
    kv = KVCacheManager(num_blocks=10, block_size=B, enable_prefix_caching=False)
    prompt = list(range(10))
    kv.allocate("a", prompt, 100)
    kv.cache_computed("a", prompt, 10)
    assert kv.allocate("b", prompt, 100) == 0


def test_bad_sizes_and_double_allocation_are_errors():
    with pytest.raises(ValueError, match="must be positive"):
        KVCacheManager(0, 16)
    kv = KVCacheManager(4, B)
    kv.allocate("a", [1], 1)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.allocate("a", [1], 1)


def test_free_all_releases_every_block_and_keeps_what_they_cached():
    """A new epoch whose KV memory outlived the old one (CacheReset with keep_prefixes): every request's
    blocks go back, and a request with the same tokens finds the computed ones."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(1, 11))
    assert kv.allocate("a", tokens, 12) == 0
    kv.cache_computed("a", tokens, 10)
    assert kv.allocate("b", [9, 9, 9], 4) == 0
    kv.free_all()
    assert kv.num_free_blocks == 8
    assert kv.allocate("a", tokens + [11, 12], 4) == 8  # both full blocks, nothing of b's


def test_a_kept_tail_gives_the_same_tokens_re_sent_everything_but_the_last_token():
    """free_all with tails (the KV memory outlived a restart): a request whose computed tokens end inside
    a block finds, re-sent, its full blocks and that block (cached = tokens computed); the block is taken
    by one request only, and forgotten once reused."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    tokens = list(range(1, 8))  # 7 computed: one full block, 3 tokens in the second
    kv.allocate("a", tokens, 8)
    kv.cache_computed("a", tokens, 7)
    kv.free_all([("a", 7, tokens[4:7])])
    assert kv.allocate("other", tokens[:5] + [99, 98, 97], 4) == 4  # another continuation: the full block only
    assert kv.allocate("a", tokens + [8], 4) == 7  # re-sent with its sampled token: only that one to compute
    assert len(kv.block_table("a")) == 2 and kv.block_table("a")[0] == kv.block_table("other")[0]
    kv.free("a")
    assert kv.allocate("twin", tokens + [8], 4) == 4  # taken (and written): kept no more
    kv.free_all()
    for i in range(6):
        kv.allocate(f"fill{i}", [50 + i], 1)  # every block reused
    assert kv.num_free_blocks == 0 and not kv._tails


def test_a_tail_is_kept_only_where_its_full_blocks_are_registered():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    tokens = list(range(1, 8))
    kv.allocate("a", tokens, 8)  # nothing registered: the tail's parent is unknown
    kv.free_all([("a", 7, tokens[4:7])])
    assert kv.allocate("a", tokens + [8], 4) == 0


def test_a_tail_re_sent_without_its_last_sampled_token_still_counts_all_but_the_last():
    """(The engine may re-send a sequence before it saw the last token the scheduler had: the tokens then
    end where the kept block does.)"""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    tokens = list(range(1, 8))
    kv.allocate("a", tokens, 8)
    kv.cache_computed("a", tokens, 7)
    kv.free_all([("a", 7, tokens[4:7])])
    assert kv.allocate("a", tokens, 8) == 6
