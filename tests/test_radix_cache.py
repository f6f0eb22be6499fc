"""RadixPrefixCache on its own and inside the scheduler: exact blocks, locks, eviction, integrity."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from justapi.core.block_pool import BlockPool
from justapi.core.radix_cache import RadixPrefixCache
from test_scheduler import add, fake_run, make, step

BS = 2


def cache_with(num_blocks=16):
    pool = BlockPool(num_blocks)
    return pool, RadixPrefixCache(pool, BS)


def check(pool, cache, held=()):
    """Integrity: the pool's counts equal the tree's references plus the blocks callers still hold."""
    owners = cache.block_owners()
    for blocks in held:
        owners.update(blocks)
    pool.check_integrity(owners)
    cache.check_integrity()


def insert_owned(pool, cache, tokens):
    """A request computes ``tokens``, inserts them, and finishes (drops its own references)."""
    blocks = pool.allocate(len(tokens) // BS)
    node = cache.insert(tokens, blocks)
    pool.decref(blocks)
    return node, blocks


def test_match_insert_and_split():
    pool, cache = cache_with()
    _, blocks = insert_owned(pool, cache, [1, 2, 3, 4, 5, 6])
    check(pool, cache)
    assert cache.num_blocks == 3
    node, got = cache.match([1, 2, 3, 4, 9, 9])
    assert got == blocks[:2]  # the [1..6] edge was split after two blocks
    assert cache.root.children[(1, 2)].token_ids == (1, 2, 3, 4)
    check(pool, cache)
    _, got = cache.match([1, 2, 3, 4, 5, 6, 7])
    assert got == blocks  # the odd last token is not a whole block
    _, got = cache.match([1, 3])
    assert got == []
    insert_owned(pool, cache, [1, 2, 3, 4, 7, 8])  # a sibling under the split node
    check(pool, cache)
    assert cache.num_blocks == 4
    assert len(cache.root.children[(1, 2)].children) == 2


def test_insert_keeps_existing_blocks_for_known_prefixes():
    pool, cache = cache_with()
    _, first = insert_owned(pool, cache, [1, 2, 3, 4])
    dup = pool.allocate(3)
    cache.insert([1, 2, 3, 4, 5, 6], dup)
    _, got = cache.match([1, 2, 3, 4, 5, 6])
    assert got == first + [dup[2]]
    check(pool, cache, held=[dup])
    pool.decref(dup)  # the duplicate copies of the first two blocks go back to the pool
    check(pool, cache)
    assert pool.num_free == 16 - 3


def test_locked_paths_are_never_evicted_and_lru_goes_first():
    pool, cache = cache_with(num_blocks=8)
    a, _ = insert_owned(pool, cache, [1, 1, 1, 1])
    b, _ = insert_owned(pool, cache, [2, 2, 2, 2])
    c, _ = insert_owned(pool, cache, [3, 3, 3, 3])
    cache.match([2, 2, 2, 2])  # touch b: a is now the least recently used
    cache.lock(c)
    assert cache.evict(2) == 2
    assert (1, 1) not in cache.root.children and (2, 2) in cache.root.children
    check(pool, cache)
    assert cache.evict(100) == 2  # b goes; c is locked
    assert list(cache.root.children) == [(3, 3)]
    cache.unlock(c)
    assert cache.evict(100) == 2
    assert cache.num_blocks == 0 and pool.num_free == 8
    check(pool, cache)


def test_eviction_frees_leaves_before_their_parents():
    pool, cache = cache_with()
    insert_owned(pool, cache, [1, 2, 3, 4, 5, 6])
    insert_owned(pool, cache, [1, 2, 7, 8])
    assert cache.evict(1) >= 1
    check(pool, cache)
    _, got = cache.match([1, 2, 3, 4])
    assert len(got) >= 1  # the shared [1, 2] parent outlives a leaf


def test_random_operations_keep_integrity():
    rng = random.Random(7)
    pool, cache = cache_with(num_blocks=40)
    held: list[tuple[object, list[int]]] = []  # (locked node, blocks a "request" holds)
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            tokens = [rng.randint(0, 2) for _ in range(2 * rng.randint(1, 6))]
            node, got = cache.match(tokens)
            need = len(tokens) // BS - len(got)
            if pool.num_free < need:
                cache.evict(need - pool.num_free)
            if pool.num_free >= need:
                cache.lock(node)
                pool.incref(got)
                blocks = got + pool.allocate(need)
                new_node = cache.insert(tokens, blocks)
                cache.lock(new_node)
                cache.unlock(node)
                held.append((new_node, blocks))
        elif op < 0.85 and held:
            node, blocks = held.pop(rng.randrange(len(held)))
            cache.unlock(node)
            pool.decref(blocks)
        else:
            cache.evict(rng.randint(1, 5))
        check(pool, cache, held=[b for _, b in held])
        locks = Counter(n for n, _ in held)
        cache.check_integrity(locks)


def test_hit_ratio_counts_prompt_blocks():
    s = make(num_blocks=64, block_size=4, chunk_size=64, prefix_cache=True)
    add(s, "a", 17, max_tokens=1)  # 4 whole blocks looked up (the last token is always computed)
    while s.has_unfinished:
        step(s)
    add(s, "b", 17, max_tokens=1)
    out = s.schedule()
    assert s.requests["b"].num_cached_tokens == 16 and out.num_scheduled_tokens["b"] == 1
    s.update(out, fake_run(s, out))  # (b ends here: one token)
    assert (s.cache.hits, s.cache.misses) == (4, 4)
    assert s.cache.hit_ratio == pytest.approx(0.5)


def test_shared_prefix_is_computed_once_while_both_run():
    s = make(num_blocks=64, block_size=4, chunk_size=64, prefix_cache=True)
    add(s, "a", 12, max_tokens=5)
    step(s)  # a's prompt is cached at the end of its prefill
    add(s, "b", 14, max_tokens=5)
    out, _ = step(s)
    assert out.num_scheduled_tokens["b"] == 2
    a, b = s.requests["a"], s.requests["b"]
    assert b.block_ids[:3] == a.block_ids[:3]
    assert s.pool.ref_counts[a.block_ids[0]] == 3  # a, b and the tree
    while s.has_unfinished:
        step(s)
    assert s.pool.num_free + s.num_cached_blocks == 64
