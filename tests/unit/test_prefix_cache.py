"""The driver's KV blocks and prefix cache (cluster.prefix_cache): names, sharing, reference counts,
LRU eviction, admission, PCP striping."""

import numpy as np
import pytest

from cluster.prefix_cache import BlockPool, PrefixCache, block_hashes, pool_identity

ROOT = pool_identity("fp", "bfloat16", "bfloat16", 4)


def names(tokens, block_size=4, root=ROOT):
    return block_hashes(np.asarray(tokens), block_size, root)


def test_a_blocks_name_depends_on_every_token_before_it_and_on_the_pool():
    a, b = names(range(12)), names([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11])
    assert len(a) == 3 and a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # block 2 has equal tokens, another parent
    assert names(range(11)) == a[:2]  # the partial block is not named
    assert names(range(12), root=pool_identity("fp", "float32", "float32", 4))[0] != a[0]
    assert names(range(12), block_size=6, root=ROOT)[0] != a[0]


def test_a_request_takes_the_longest_cached_prefix_and_always_computes_its_last_token():
    cache = PrefixCache(16, pcp=1, block_size=4)
    prompt = list(range(10))
    assert cache.admit("a", 10, names(prompt)) == 0
    cache.written("a", names(prompt))
    cache.release("a")
    assert cache.admit("b", 14, names(prompt + [7, 7, 7, 7])) == 8  # two full blocks of a's
    assert cache.tables["b"][0][:2] == [cache.ranks[0].find(n) for n in names(prompt)]
    assert cache.admit("c", 8, names(prompt[:8])) == 4  # cached whole: its last block is computed again
    assert cache.admit("d", 3, names(prompt[:3])) == 0
    assert cache.report()["hit_tokens"] == 12


def test_shared_blocks_are_counted_and_only_unused_named_blocks_are_evicted_lru_tails_first():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.name(a[0], b"x0")
    pool.name(a[1], b"x1")
    pool.share(a[0])  # a second request uses block a[0]
    pool.drop(a[::-1])  # the first releases: a[1] is cached, a[0] still used by the second
    assert pool.in_use == 1 and pool.cached == 1 and pool.available == 3
    got = pool.allocate(3)  # 2 free, then the cached a[1] is evicted
    assert a[1] in got and pool.evictions == 1 and pool.find(b"x1") is None and pool.find(b"x0") == a[0]
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.drop(got + [a[0]])
    assert pool.in_use == 0 and pool.cached == 1 and pool.available == 4


def test_admission_counts_the_cached_blocks_a_request_takes_out_of_the_evictable_set():
    cache = PrefixCache(4, pcp=1, block_size=4)
    prompt = list(range(16))
    cache.admit("a", 16, names(prompt))
    cache.written("a", names(prompt))
    cache.release("a")  # 4 cached blocks, 0 free
    more = prompt[:12] + [5, 5, 5, 5, 5]  # reuses 3 blocks, needs 2 new: only 1 evictable left
    assert not cache.fits(17, names(more)) and cache.admit("b", 17, names(more)) is None
    assert cache.report()["blocks_cached"] == [4] and cache.tables == {}  # nothing taken
    assert cache.admit("c", 16, names(prompt[:12] + [5, 5, 5, 5])) == 12  # 3 reused + 1 evicted
    assert cache.report()["evictions"] == 1


def test_under_pcp_block_j_is_named_and_found_on_rank_j_mod_pcp():
    cache = PrefixCache(8, pcp=2, block_size=4)
    prompt = list(range(20))  # 5 blocks: ranks 0,1,0,1,0
    cache.admit("a", 20, names(prompt))
    assert [len(t) for t in cache.tables["a"]] == [3, 2]
    cache.written("a", names(prompt))
    table = [list(t) for t in cache.tables["a"]]
    cache.release("a")
    assert cache.admit("b", 23, names(prompt + [1, 2, 3])) == 20
    assert cache.tables["b"][0][:3] == table[0] and cache.tables["b"][1][:2] == table[1]
    assert [len(t) for t in cache.tables["b"]] == [3, 3]


def test_without_the_cache_nothing_is_named_and_every_block_comes_back_free():
    cache = PrefixCache(8, pcp=1, block_size=4, enabled=False)
    prompt = list(range(16))
    assert cache.admit("a", 16, names(prompt)) == 0
    cache.written("a", names(prompt))
    cache.release("a")
    assert cache.admit("b", 16, names(prompt)) == 0
    assert cache.report()["blocks_cached"] == [0] and cache.report()["blocks_in_use"] == [4]


def test_a_request_released_before_it_completed_names_nothing_and_release_is_idempotent():
    cache = PrefixCache(8, pcp=1, block_size=4)
    prompt = list(range(16))
    cache.admit("a", 16, names(prompt))
    assert cache.release("a") and not cache.release("a")
    assert cache.report()["blocks_cached"] == [0] and cache.admit("b", 16, names(prompt)) == 0
    with pytest.raises(ValueError, match="already holds blocks"):
        cache.admit("b", 4, names(prompt[:4]))
