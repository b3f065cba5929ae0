"""Paged KV block pool: reference-counted blocks, an LRU free list, and the prefix-cache map.

Free blocks that hold a cached prefix stay findable until they are reused; the free list hands
out blocks with no cached content first, then cached ones least-recently-freed first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def hash_block(
    parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple[object, ...]
) -> bytes:
    """Hash of one full block, chained over its parent so equal hashes mean equal prefixes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra_keys: tuple[object, ...]
) -> None:
    """Append the hashes of the full blocks of `token_ids` not hashed yet (in place)."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start : start + block_size], extra_keys))


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the cache


class BlockPool:
    """Owns every block. Not thread-safe: only the engine thread touches it."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Ordered: the front is handed out first (uncached blocks, then LRU cached blocks).
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks referenced by live requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free list in hand-out order (for tests and introspection)."""
        return list(self._free)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` blocks off the free list, evicting their cached content; caller checks space."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                # Evicted: its content is about to be overwritten.
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits; a hit on a free block takes it off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each. Pass a request's blocks tail first: tails are evicted first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                h = block.block_hash
                if h is None or self._cached.get(h) is not block:
                    # Nothing findable in it: hand it out before any cached block.
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full block under its prefix hash (first writer wins on duplicates)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, block)
