"""Block tables, prefix hits and the LRU free list with exact block ids (block size 4)."""

from __future__ import annotations

from inference_svc.engine.block_pool import hash_block
from inference_svc.engine.kv_cache_manager import KVCacheManager
from inference_svc.engine.request import Request
from inference_svc.engine.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int], extra: tuple[object, ...] = ()) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_extra_keys=extra)


def _schedule(kv: KVCacheManager, req: Request) -> tuple[int, ...] | None:
    """What the scheduler does on first admission: prefix lookup then allocation for the rest."""
    hit = kv.find_prefix(req)
    req.num_computed_tokens = hit.num_tokens
    blocks = kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit)
    if blocks is None:
        req.num_computed_tokens = 0
        return None
    req.num_computed_tokens = req.num_tokens
    return blocks.block_ids


def _refcounts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_allocation_grows_one_block_per_boundary() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = _req("a", list(range(1, 6)))  # 5 tokens -> 2 blocks
    assert _schedule(kv, req) == (0, 1)
    for expected_len, token in [(2, 6), (2, 7), (2, 8), (3, 9)]:
        req.append_token(token)
        blocks = kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert blocks is not None and len(blocks) == expected_len
    assert kv.block_ids("a").block_ids == (0, 1, 2)
    assert _refcounts(kv) == [1, 1, 1, 0, 0, 0, 0, 0]
    kv.free(req)
    assert _refcounts(kv) == [0] * 8
    # Block 2 held a partial block (no hash): it goes to the front; full blocks 1 then 0 at the back.
    assert kv.pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]


def test_prefix_hit_shares_blocks_and_caps_at_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(100, 112)))  # 12 tokens = 3 full blocks
    assert _schedule(kv, a) == (0, 1, 2)
    b = _req("b", [*range(100, 108), 7, 7])  # shares 2 full blocks
    hit = kv.find_prefix(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1] and hit.num_tokens == 8
    assert _schedule(kv, b) == (0, 1, 3)
    assert _refcounts(kv)[:4] == [2, 2, 1, 1]
    # The same 12 tokens again: only 2 blocks may hit, the last token must be computed.
    c = _req("c", list(range(100, 112)))
    assert kv.find_prefix(c).num_tokens == 8
    assert _schedule(kv, c) == (0, 1, 4)
    # A different adapter (extra key) never shares.
    d = _req("d", list(range(100, 112)), extra=("adapter-1",))
    assert kv.find_prefix(d).num_tokens == 0
    for r in (a, b, c):
        kv.free(r)
    assert _refcounts(kv) == [0] * 8
    assert kv.num_free_blocks == 8


def test_cached_free_blocks_are_evicted_lru_and_rehit_from_free_list() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = _req("a", [*range(8), 99])  # blocks 0,1 full, 2 partial
    assert _schedule(kv, a) == (0, 1, 2)
    kv.free(a)
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]
    # A hit on free cached blocks takes them off the free list.
    b = _req("b", [*range(8), 42])
    assert _schedule(kv, b) == (0, 1, 2)
    assert kv.pool.free_block_ids() == [3]
    kv.free(b)
    # New unrelated 16 tokens need all 4 blocks: the uncached go first, then LRU tail (1), head (0).
    c = _req("c", list(range(500, 516)))
    assert _schedule(kv, c) == (2, 3, 1, 0)
    assert kv.find_prefix(_req("x", [*range(8), 1])).num_tokens == 0  # evicted
    kv.free(c)
    assert _refcounts(kv) == [0] * 4


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", list(range(8)))
    assert _schedule(kv, a) == (0, 1)
    before = (kv.pool.free_block_ids(), _refcounts(kv))
    b = _req("b", list(range(50, 59)))  # needs 3 blocks, 1 free
    assert _schedule(kv, b) is None
    assert (kv.pool.free_block_ids(), _refcounts(kv)) == before
    assert kv.block_ids("b").block_ids == ()


def test_hit_on_free_block_is_not_counted_as_free_space() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", [*range(8), 1])
    assert _schedule(kv, a) == (0, 1, 2)
    kv.free(a)
    # Hits blocks 0,1 (both free) and needs 2 more: 3 - 2 hit = 1 free block left, so refuse.
    b = _req("b", list(range(8)) + list(range(60, 66)))
    assert _schedule(kv, b) is None
    assert _refcounts(kv) == [0, 0, 0]


def test_hash_chain_depends_on_parent_and_extra_keys() -> None:
    h1 = hash_block(None, [1, 2, 3, 4], ())
    assert hash_block(None, [1, 2, 3, 4], ()) == h1
    assert hash_block(h1, [1, 2, 3, 4], ()) != h1
    assert hash_block(None, [1, 2, 3, 4], ("lora",)) != h1
    assert hash_block(None, [1, 2, 3, 5], ()) != h1
