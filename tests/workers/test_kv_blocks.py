"""KV blocks: the pool's ref counts and prefix cache, the hash chain, KV events,
and the cache manager's prefix lookup, slot allocation and freeing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.workers.kv import hashing
from pdserve.workers.kv.block_pool import BlockPool
from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.kv.events import KVEvent, KVEventKind
from pdserve.workers.kv.hashing import ROOT_HASH, extend_block_hashes, hash_block
from pdserve.workers.request import Request
from pdserve.workers.sampling_params import SamplingParams

BS = 4  # block size


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=8), max_tokens=8)


def cached_pool(num_blocks: int, num_cached: int, record_events: bool = False) -> tuple[BlockPool, list[int]]:
    """A pool whose first `num_cached` allocated blocks are cached (hash 100+i) and freed."""
    pool = BlockPool(num_blocks, record_events=record_events)
    blocks = pool.allocate(num_cached)
    for i, b in enumerate(blocks):
        pool.cache(b, 100 + i, None)
    return pool, blocks


# -- pool: ref counts --------------------------------------------------------------


def test_allocate_and_free_track_ref_counts() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8
    assert pool.num_free == 0 and pool.num_used == 8
    pool.free(a)
    assert pool.num_free == 3
    assert sorted(pool.allocate(3)) == sorted(a)  # the freed blocks come back, nothing else


def test_over_allocation_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError, match="cannot allocate 2"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert len(pool.allocate(1)) == 1


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks[:1])


def test_shared_block_stays_in_use_until_every_owner_frees_it() -> None:
    pool, [block] = cached_pool(2, 1)
    pool.touch([block])  # a second owner found it by hash
    pool.free([block])
    assert pool.num_free == 1  # only the other, empty block
    assert pool.allocate(1) != [block]
    pool.free([block])
    assert pool.num_free == 1 and pool.lookup(100) == block  # now evictable, still cached


def test_invalid_pool_size() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


# -- pool: prefix cache ------------------------------------------------------------


def test_cached_blocks_are_found_after_their_owner_frees_them() -> None:
    pool, blocks = cached_pool(4, 2)
    pool.free(blocks)
    assert pool.lookup(100) == blocks[0] and pool.lookup(101) == blocks[1]
    assert pool.num_free == 4  # cached-but-unreferenced blocks count as free


def test_empty_blocks_are_used_before_cached_ones_are_evicted() -> None:
    pool, blocks = cached_pool(5, 3)
    pool.free(blocks)
    pool.allocate(2)  # the two empty blocks
    assert all(pool.lookup(100 + i) == b for i, b in enumerate(blocks))


def test_eviction_is_least_recently_used_first() -> None:
    pool, blocks = cached_pool(3, 3)
    pool.free([blocks[2], blocks[0], blocks[1]])  # LRU order: 2, 0, 1
    assert pool.allocate(1) == [blocks[2]]
    assert pool.lookup(102) is None and pool.lookup(100) == blocks[0]
    assert pool.allocate(1) == [blocks[0]]
    assert pool.lookup(100) is None and pool.lookup(101) == blocks[1]


def test_touch_revives_an_evictable_block() -> None:
    pool, blocks = cached_pool(3, 3)
    pool.free(blocks)
    pool.touch([blocks[0]])  # the LRU one
    assert pool.num_free == 2
    assert sorted(pool.allocate(2)) == sorted(blocks[1:])  # block 0 is no longer evictable
    with pytest.raises(ValueError):
        pool.allocate(1)
    assert pool.lookup(100) == blocks[0]


def test_refreed_block_becomes_most_recently_used() -> None:
    pool, blocks = cached_pool(2, 2)
    pool.free(blocks)  # LRU order: 0, 1
    pool.touch([blocks[0]])
    pool.free([blocks[0]])  # LRU order: 1, 0
    assert pool.allocate(1) == [blocks[1]]


def test_same_content_is_cached_once() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 7, None)
    pool.cache(b, 7, None)
    assert pool.lookup(7) == a
    pool.free([b])
    pool.allocate(1)  # b was not cached: it went back empty and is reused without evicting a
    assert pool.lookup(7) == a


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.allocate(1)
    pool.cache(a, 7, None)
    assert pool.lookup(7) is None


def test_reset_cache_forgets_unreferenced_blocks_only() -> None:
    pool, blocks = cached_pool(3, 2)
    pool.free(blocks[:1])
    pool.reset_cache()
    assert pool.lookup(100) is None and pool.lookup(101) == blocks[1]
    assert pool.num_free == 2


# -- hashing -----------------------------------------------------------------------


def test_hash_chain_depends_on_the_parent() -> None:
    tokens = [1, 2, 3, 4]
    first = hash_block(ROOT_HASH, tokens)
    assert hash_block(first, tokens) != first
    assert hash_block(ROOT_HASH, tokens) == first
    assert hash_block(ROOT_HASH, [1, 2, 3, 5]) != first
    assert hash_block(ROOT_HASH, [4, 3, 2, 1]) != first


def test_extend_block_hashes_covers_full_blocks_only_and_is_incremental() -> None:
    tokens = list(range(11))
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BS)
    assert hashes == [hash_block(ROOT_HASH, tokens[:4]), hash_block(hash_block(ROOT_HASH, tokens[:4]), tokens[4:8])]
    extend_block_hashes(hashes, tokens + [11], BS)
    assert len(hashes) == 3 and hashes[2] == hash_block(hashes[1], tokens[8:] + [11])


def test_hashes_are_stable_across_processes() -> None:
    """Routers compare hashes from different workers: no per-process salt (PYTHONHASHSEED)."""
    # Load the module file alone: importing the pdserve package would pull in torch (seconds).
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('h', sys.argv[1]);"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
        "h = m.hash_block(m.ROOT_HASH, [1, 2, 3, 4]); print(h, m.hash_block(h, [5, 6, 7, 8]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    cmd = [sys.executable, "-c", code, hashing.__file__]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert out.split() == [str(h), str(hash_block(h, [5, 6, 7, 8]))]


# -- events ------------------------------------------------------------------------


def test_events_stored_on_cache_removed_on_eviction() -> None:
    pool = BlockPool(1, record_events=True)
    [a] = pool.allocate(1)
    pool.cache(a, 7, 3)
    pool.free([a])
    pool.allocate(1)  # evicts hash 7
    assert pool.take_events() == [KVEvent(KVEventKind.STORED, 7, 3), KVEvent(KVEventKind.REMOVED, 7)]
    assert pool.take_events() == []


def test_no_events_unless_recording() -> None:
    pool = BlockPool(1)
    [a] = pool.allocate(1)
    pool.cache(a, 7, None)
    pool.free([a])
    pool.allocate(1)
    assert pool.take_events() == []


def test_manager_records_the_hash_chain_in_events() -> None:
    kv = KVCacheManager(4, BS, record_events=True)
    req = make_request("a", list(range(9)))
    assert kv.allocate_slots(req, 9)
    req.num_computed_tokens = 9
    kv.cache_computed_blocks(req)
    h0 = hash_block(ROOT_HASH, [0, 1, 2, 3])
    h1 = hash_block(h0, [4, 5, 6, 7])
    assert kv.pool.take_events() == [KVEvent(KVEventKind.STORED, h0, ROOT_HASH), KVEvent(KVEventKind.STORED, h1, h0)]


# -- cache manager -----------------------------------------------------------------


def run_prefill(kv: KVCacheManager, req: Request) -> None:
    """Admit `req` from its cached prefix and compute its whole prompt."""
    blocks, num_cached = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, blocks)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)


def test_find_cached_prefix_reuses_a_freed_request_blocks() -> None:
    kv = KVCacheManager(8, BS)
    first = make_request("a", list(range(10)))
    run_prefill(kv, first)
    held = kv.blocks_of("a")
    kv.free(first)

    second = make_request("b", list(range(8)) + [50, 51, 52])
    blocks, n = kv.find_cached_prefix(second)
    assert blocks == held[:2] and n == 8
    third = make_request("c", [99] + list(range(1, 10)))  # differs in block 0: nothing reusable
    assert kv.find_cached_prefix(third) == ([], 0)


@pytest.mark.parametrize("prompt_len", [8, 9, 12])
def test_find_cached_prefix_leaves_a_token_to_compute(prompt_len: int) -> None:
    kv = KVCacheManager(8, BS)
    run_prefill(kv, make_request("a", list(range(prompt_len))))
    again = make_request("b", list(range(prompt_len)))
    blocks, n = kv.find_cached_prefix(again)
    assert n < prompt_len
    assert n == (prompt_len - 1) // BS * BS
    assert len(blocks) == n // BS


def test_prefix_caching_disabled_finds_nothing() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    run_prefill(kv, make_request("a", list(range(9))))
    assert kv.find_cached_prefix(make_request("b", list(range(9)))) == ([], 0)


def test_allocate_slots_grows_by_whole_blocks() -> None:
    kv = KVCacheManager(8, BS)
    req = make_request("a", list(range(5)))
    assert kv.allocate_slots(req, 5)
    assert len(kv.blocks_of("a")) == 2
    req.num_computed_tokens = 5
    for _ in range(3):  # tokens 6..8 fit in block 2
        req.append_token(0)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert len(kv.blocks_of("a")) == 2
    req.append_token(0)
    assert kv.allocate_slots(req, 1)
    assert len(kv.blocks_of("a")) == 3


def test_allocate_slots_fails_without_changing_anything() -> None:
    kv = KVCacheManager(4, BS)
    hog = make_request("hog", list(range(100, 109)))
    assert kv.allocate_slots(hog, 9)  # 3 blocks
    req = make_request("a", list(range(9)))
    assert not kv.allocate_slots(req, 9)
    assert kv.blocks_of("a") == [] and kv.pool.num_free == 1


def test_allocate_slots_counts_revived_cached_blocks_as_consumed() -> None:
    """Two cached blocks nobody holds count in num_free; taking them must not also
    count them as room for new blocks."""
    kv = KVCacheManager(4, BS)
    first = make_request("a", list(range(9)))
    run_prefill(kv, first)  # 3 blocks: 2 cached full + 1 partial
    kv.free(first)
    assert kv.pool.num_free == 4

    req = make_request("b", list(range(8)) + list(range(50, 62)))  # 20 tokens: 5 blocks, 2 cached
    blocks, n = kv.find_cached_prefix(req)
    assert n == 8
    before = (list(kv.pool.ref_counts), kv.pool.num_free)
    assert not kv.allocate_slots(req, 12, blocks)  # needs 3 new + 2 revived > 4
    assert (list(kv.pool.ref_counts), kv.pool.num_free) == before
    assert kv.blocks_of("b") == []
    assert kv.find_cached_prefix(req) == (blocks, 8)  # still cached, still reusable

    short = make_request("c", list(range(8)) + [50, 51, 52, 53, 54])  # 13 tokens: 2 cached + 2 new
    blocks, n = kv.find_cached_prefix(short)
    assert kv.allocate_slots(short, short.num_tokens - n, blocks)
    assert kv.blocks_of("c")[:2] == blocks and len(kv.blocks_of("c")) == 4 and kv.pool.num_free == 0


def test_shared_prefix_survives_one_owner_freeing() -> None:
    kv = KVCacheManager(6, BS)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    b = make_request("b", list(range(9)))
    run_prefill(kv, b)
    assert kv.blocks_of("b")[:2] == kv.blocks_of("a")[:2]
    kv.free(a)
    # The shared blocks are still b's: allocating everything else must not take them.
    kv.pool.allocate(kv.pool.num_free)
    assert all(kv.pool.ref_counts[x] == 1 for x in kv.blocks_of("b"))


def test_free_returns_every_block() -> None:
    kv = KVCacheManager(8, BS)
    reqs = [make_request(str(i), list(range(i * 20, i * 20 + 6 + i))) for i in range(3)]
    for r in reqs:
        run_prefill(kv, r)
    assert kv.pool.num_free == 8 - sum(len(kv.blocks_of(r.request_id)) for r in reqs)
    for r in reqs:
        kv.free(r)
    assert kv.pool.num_free == 8 and kv.pool.num_used == 0
    assert all(c == 0 for c in kv.pool.ref_counts)
    kv.free(reqs[0])  # freeing again is a no-op, not a double free
    assert kv.pool.num_free == 8


def test_free_releases_the_tail_first() -> None:
    """A freed request's last block is evicted before its first (the prefix others share)."""
    kv = KVCacheManager(3, BS)
    a = make_request("a", list(range(12)))
    run_prefill(kv, a)
    blocks = kv.blocks_of("a")
    kv.free(a)
    assert kv.pool.allocate(1) == [blocks[2]]
    assert kv.find_cached_prefix(make_request("b", list(range(12)))) == (blocks[:2], 8)
