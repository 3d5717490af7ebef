"""BlockPool: the free list, reference counts and content cache of one pool of KV blocks
(the picture of who owns a block is in engine/kv/manager.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.kv.prefix_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy the KV of block `src` (in one pool) to block `dst` (in the other)."""

    src: int
    dst: int


class BlockPool:
    """A free list, reference counts and a content cache (blocks registered by hash) over
    block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        # LIFO free list: the most recently freed (cache-warm) block is reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts = [0] * num_blocks
        # Prefix caching: the hash each cached block is registered under, the block of
        # each hash, and the cached blocks nobody holds, least recently released first.
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free, or cached and held by nobody."""
        return len(self._free) + len(self._evictable)

    @property
    def num_unused(self) -> int:
        """Blocks on the free list: free, and caching nothing."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered in the content cache (held or not)."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody holds (counted as free)."""
        return len(self._evictable)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks (ref count 1 each): free ones first, then cached ones
        nobody holds, least recently used first (they leave the cache)."""
        if num_blocks > self.num_free:
            raise MemoryError(f"asked for {num_blocks} blocks, {self.num_free} free")
        if num_blocks == 0:
            return []
        free = self._free
        from_free = min(num_blocks, len(free))
        # Popped from the end, so a fresh pool hands out ascending runs (0, 1, 2, ...):
        # a run of consecutive ids is one contiguous piece of the block-major cache, which
        # a KV transfer moves as one message.
        block_ids = free[:-from_free - 1:-1] if from_free else []
        if from_free:
            del free[-from_free:]
        for _ in range(num_blocks - from_free):
            block_id, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of[block_id]]
            self._hash_of[block_id] = None
            self.num_evicted += 1
            block_ids.append(block_id)
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        return block_ids

    def sort_free(self) -> None:
        """Put the free list in a fresh pool's order: allocations hand out ascending runs again."""
        self._free.sort(reverse=True)

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a holder to blocks in use, or to cached blocks nobody holds (a prefix hit)."""
        ref_counts = self._ref_counts
        for block_id in block_ids:
            if ref_counts[block_id] == 0:
                assert block_id in self._evictable, f"incref of free block {block_id}"
                del self._evictable[block_id]
            ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block. Blocks nobody holds return to the free list, or,
        if cached, stay cached as the most recently used."""
        ref_counts = self._ref_counts
        free = self._free
        hash_of = self._hash_of
        evictable = self._evictable
        # Reversed so that a table freed whole is handed out again in the same order, and
        # its last (least shared) cached blocks are evicted before its first.
        for block_id in reversed(list(block_ids)):
            count = ref_counts[block_id]
            assert count > 0, f"double free of block {block_id}"
            ref_counts[block_id] = count - 1
            if count == 1:
                if hash_of[block_id] is None:
                    free.append(block_id)
                else:
                    evictable[block_id] = None

    # ------------------------------------------------------------------ cache
    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Cache a held block whose KV is complete under `block_hash`. False (nothing
        changes) if another block is cached under it, or this one is under another."""
        if block_hash in self._cached or self._hash_of[block_id] is not None:
            return False
        assert self._ref_counts[block_id] > 0, f"register of unheld block {block_id}"
        self._cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def match(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of `hashes` from its start."""
        cached = self._cached
        matched: list[int] = []
        for block_hash in hashes:
            block_id = cached.get(block_hash)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def refresh(self, hashes: Iterable[BlockHash]) -> None:
        """Make the cached blocks of `hashes` that nobody holds the most recently used."""
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is not None and block_id in self._evictable:
                self._evictable.move_to_end(block_id)

    def is_evictable(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

    def num_holders(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def hash_of(self, block_id: int) -> BlockHash | None:
        """The hash the block is cached under (None: not cached)."""
        return self._hash_of[block_id]

    def check_integrity(self, held: dict[int, int]) -> None:
        """Assert the pool agrees with `held` (block id -> number of holders)."""
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        for block_id in free:
            if self._ref_counts[block_id] != 0 or block_id in held:
                raise AssertionError(f"block {block_id} is free and held")
            if self._hash_of[block_id] is not None:
                raise AssertionError(f"block {block_id} is on the free list and cached")
        for block_id in self._evictable:
            if self._ref_counts[block_id] != 0 or block_id in held or block_id in free:
                raise AssertionError(f"evictable block {block_id} is held or free")
            if self._hash_of[block_id] is None:
                raise AssertionError(f"evictable block {block_id} is not cached")
        for block_id in range(self.num_blocks):
            expected = held.get(block_id, 0)
            if self._ref_counts[block_id] != expected:
                raise AssertionError(
                    f"block {block_id}: ref count {self._ref_counts[block_id]}, held by {expected}"
                )
        if len(free) + len(self._evictable) + len(held) != self.num_blocks:
            raise AssertionError("blocks lost: neither free, cached nor held")
        for block_hash, block_id in self._cached.items():
            if self._hash_of[block_id] != block_hash:
                raise AssertionError(f"block {block_id} and the cache disagree on its hash")
        if sum(block_hash is not None for block_hash in self._hash_of) != len(self._cached):
            raise AssertionError("a block carries a hash the cache does not know")
