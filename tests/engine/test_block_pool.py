"""Block pool: hand-out order, cache registration, eviction on reuse, reference counting."""

from __future__ import annotations

import pytest

from inference_svc.engine.block_pool import BlockPool, extend_block_hashes, hash_block


def test_free_list_order_and_eviction() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    assert [a.block_id, b.block_id, c.block_id] == [0, 1, 2]
    pool.cache_block(a, b"h-a")
    pool.cache_block(b, b"h-b")
    pool.free([b, a, c])  # tail first, as a request frees
    # c holds nothing findable: first out; then the untouched 3; then cached b before a.
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.lookup(b"h-a") is a
    d, e, f = pool.allocate(3)
    assert [d.block_id, e.block_id, f.block_id] == [2, 3, 1]
    assert pool.lookup(b"h-b") is None and f.block_hash is None  # evicted on reuse
    assert pool.lookup(b"h-a") is a


def test_touch_shares_and_takes_blocks_off_the_free_list() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h")
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])  # a cache hit on a free block revives it
    assert a.ref_cnt == 1 and pool.free_block_ids() == [1]
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)


def test_duplicate_content_keeps_the_first_block_findable() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.lookup(b"same") is a
    pool.free([b, a])
    # b is not findable under its hash: it is handed out before the cached a.
    assert pool.free_block_ids() == [1, 2, 0]


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h")
    assert pool.lookup(b"h") is None and a.block_hash is None


def test_block_hashes_cover_full_blocks_only() -> None:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7], 4, ())
    assert hashes == [hash_block(None, [1, 2, 3, 4], ())]
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, ())
    assert hashes[1] == hash_block(hashes[0], [5, 6, 7, 8], ())
    assert len(hashes) == 2
