"""The prefix cache's index from plain numbers: chained hashes, longest-prefix match, LRU
eviction that never takes a pinned block."""

from __future__ import annotations

import pytest

from disagg.engine.prefix_cache import PrefixCache, block_hashes, root_hash

pytestmark = pytest.mark.unit
ROOT = root_hash("fp", "float32", 4)


def test_hashes_cover_full_blocks_only_and_chain():
    a = block_hashes(ROOT, list(range(10)), 4)
    assert len(a) == 2  # 10 tokens: two full blocks, the last 2 tokens have no hash
    b = block_hashes(ROOT, list(range(8)) + [99, 98, 97, 96], 4)
    assert b[:2] == a  # a shared prefix shares its hashes
    # the same block after a different prefix is a different block
    c = block_hashes(ROOT, [7, 7, 7, 7] + list(range(4, 8)), 4)
    assert c[1] != a[1]


def test_salt_model_and_dtype_change_every_hash():
    ids = list(range(8))
    base = block_hashes(ROOT, ids, 4)
    assert block_hashes(ROOT, ids, 4, salt="key-a") != base
    assert block_hashes(ROOT, ids, 4, salt="key-a") != block_hashes(ROOT, ids, 4, salt="key-b")
    assert block_hashes(root_hash("other", "float32", 4), ids, 4)[0] != base[0]
    assert block_hashes(root_hash("fp", "bfloat16", 4), ids, 4)[0] != base[0]


def test_match_finds_the_longest_cached_prefix():
    cache = PrefixCache(num_blocks=8, block_size=4)
    h = block_hashes(ROOT, list(range(16)), 4)
    placed = cache.allocate(h[:3])
    assert [i for i, _ in placed] == [0, 1, 2]
    found = cache.match(h)
    assert found == [b for _, b in placed]
    cache.release(found)
    assert cache.stats.num_hit_tokens == 12 and cache.stats.num_queried_tokens == 16
    assert cache.match(block_hashes(ROOT, [5] * 16, 4)) == []


def test_allocate_skips_what_is_cached():
    cache = PrefixCache(num_blocks=8, block_size=4)
    h = block_hashes(ROOT, list(range(12)), 4)
    cache.allocate(h[:2])
    assert [i for i, _ in cache.allocate(h)] == [2]
    assert cache.num_cached_blocks == 3


def test_lru_eviction_takes_the_oldest_and_the_chain_tail_first():
    cache = PrefixCache(num_blocks=3, block_size=4)
    old = block_hashes(ROOT, list(range(12)), 4)
    cache.allocate(old)
    cache.release(cache.match(old[:1]))  # the chain's head is touched: used again
    new = block_hashes(ROOT, [9] * 4, 4)
    cache.allocate(new)  # evicts old[1], now the least recently used
    assert cache.stats.num_evicted_blocks == 1
    assert len(cache.match(old, count=False)) == 1  # old[0] stays, the rest is unreachable
    cache.release(cache.match(old[:1], count=False))


def test_a_pinned_block_is_never_evicted_and_a_full_cache_skips():
    cache = PrefixCache(num_blocks=2, block_size=4)
    h = block_hashes(ROOT, list(range(8)), 4)
    cache.allocate(h)
    pinned = cache.match(h)  # a copy in progress
    assert cache.allocate(block_hashes(ROOT, [3] * 8, 4)) == []  # no room, nothing evicted
    assert cache.stats.num_evicted_blocks == 0
    cache.release(pinned)
    assert len(cache.allocate(block_hashes(ROOT, [3] * 8, 4))) == 2
    assert cache.stats.num_evicted_blocks == 2


def test_memory_stays_inside_the_budget_under_many_distinct_prompts():
    cache = PrefixCache(num_blocks=16, block_size=4)
    for i in range(500):
        h = block_hashes(ROOT, [i] * 20, 4)
        cache.release(cache.match(h))
        cache.allocate(h)
        assert cache.num_cached_blocks <= 16
    assert cache.stats.num_evicted_blocks == 500 * 5 - 16
