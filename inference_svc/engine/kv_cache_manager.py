"""KV cache manager: the scheduler's view of the paged pool (block tables, prefix hits, space).

The scheduler sees only `KVCacheBlocks` and counts; block objects and hashes stay in here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from inference_svc.engine.block_pool import BlockPool, KVBlock, extend_block_hashes
from inference_svc.engine.request import Request


@dataclass(frozen=True)
class KVCacheBlocks:
    """Physical block ids, in order; the boundary type between the cache and the scheduler."""

    block_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class PrefixHit:
    """Blocks found in the prefix cache for a new request, and how many tokens they cover."""

    blocks: tuple[KVBlock, ...]
    num_tokens: int


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """Per-request block tables over a BlockPool. Used only from the engine thread."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading table blocks already registered
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def block_ids(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(b.block_id for b in self._tables.get(request_id, ())))

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest cached run of full blocks; capped so the last token is always computed."""
        if not self.enable_prefix_caching:
            return PrefixHit((), 0)
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return PrefixHit(tuple(hits), len(hits) * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens of `request`; None (and no change) if full.

        With a prefix hit (first scheduling only), the hit blocks start the table and the
        request's computed count must already equal `prefix.num_tokens`.
        """
        table = self._tables.get(request.request_id, [])
        hit_blocks = list(prefix.blocks) if prefix else []
        # Hit blocks sitting on the free list cannot be counted as free space for this request.
        evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(table) - len(hit_blocks)
        if need > self.pool.num_free_blocks - evictable_hits:
            return None
        if hit_blocks:
            self.pool.touch(hit_blocks)
            table = table + hit_blocks
        if need > 0:
            table = table + self.pool.allocate(need)
        self._tables[request.request_id] = table
        self._cache_full_blocks(request, table, total)
        return KVCacheBlocks(tuple(b.block_id for b in table))

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queried_tokens += num_prompt_tokens
        self.stats.hit_tokens += num_hit_tokens

    def free(self, request: Request) -> None:
        """Return the request's blocks (tail first, so tails are evicted before shared heads)."""
        table = self._tables.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free(reversed(table))

    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(
            request.block_hashes, request.token_ids, self.block_size, request.cache_extra_keys
        )

    def _cache_full_blocks(self, request: Request, table: list[KVBlock], num_tokens: int) -> None:
        # Blocks full once this step's tokens are written: their token ids are known now and
        # within a layer every write precedes every read, so a same-step hit is safe.
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(self._num_cached.get(request.request_id, 0), num_full):
            self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_cached[request.request_id] = max(num_full, 0)
