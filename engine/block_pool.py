"""Block pools and the per-request block tables of the paged KV cache.

Picture of the ownership this module keeps (NOTE: the invariant the property
tests check):

    device BlockPool:  [free list] + [cached, unreferenced (LRU)] + [blocks held]
    swap   BlockPool:  [free list] + [swap blocks of each SWAPPED request]

Every block id is in exactly one of those places. A held block's reference
count is the number of holders: the block tables of requests (several, when a
prefix is shared), and fences. With prefix caching, a full block whose KV is
computed is registered under the hash of its content (engine/prefix_hash.py);
when its last holder lets go it stays cached, counted as free, until an
allocation that finds the free list empty evicts it, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.prefix_hash import BlockHash


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

    def is_evictable(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

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


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached blocks that start a request's table: the KV of its first
    len(block_ids) * block_size tokens. `num_evictable` of them are held by nobody
    now, so taking them takes from the free count."""

    block_ids: tuple[int, ...]
    num_evictable: int

    def __bool__(self) -> bool:
        return bool(self.block_ids)

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


NO_PREFIX = PrefixHit((), 0)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counts of one engine."""

    # Prompt tokens looked up at admissions that prefill here, and those found cached.
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    # Prompt blocks of requests whose KV arrives from elsewhere (a handoff), and those
    # already held here, which the transfer skips.
    num_received_blocks_queried: int = 0
    num_received_blocks_hit: int = 0


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy the KV of block `src` (in one pool) to block `dst` (in the other)."""

    src: int
    dst: int


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    """Block tables of the requests that hold KV, over a device pool and a CPU swap pool.

    Each request holding device blocks owns a row of `block_tables`, a
    persistent `[num_rows, max_blocks_per_seq]` array the model runner gathers
    from without rebuilding it every step. Only the appended entries are
    written as a table grows.
    """

    def __init__(
        self,
        num_blocks: int,
        num_swap_blocks: int,
        block_size: int,
        max_blocks_per_seq: int,
        initial_rows: int = 64,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap_blocks)
        self.block_tables = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int64)
        self._free_rows: list[int] = list(range(initial_rows - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._rows: dict[str, int] = {}
        self._swapped: dict[str, list[int]] = {}
        # Blocks no request owns that may still be written from outside (see fence()).
        self._fenced: dict[str, list[int]] = {}
        # Prefix caching: how many of each table's leading blocks were offered to the
        # cache (registered, or already cached under another block).
        self._num_registered: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ device
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks a request must add so that its table covers `num_tokens` tokens."""
        table = self._tables.get(request_id)
        held = 0 if table is None else len(table)
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def allocate_slots(self, request_id: str, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Grow the request's table to cover `num_tokens` tokens; False (and no change) if blocks
        are short. `prefix`: a new table starts with these cached blocks (match_prefix), shared."""
        table = self._tables.get(request_id)
        num_new = -(num_tokens // -self.block_size) - (0 if table is None else len(table))
        if prefix:
            assert table is None, "a prefix starts a new table"
            num_new -= len(prefix.block_ids)
            if num_new + prefix.num_evictable > self.pool.num_free:
                return False
        elif num_new > self.pool.num_free:
            return False  # NOTE: an existing table, even an empty one, stays with its request
        if table is None:
            table = self._new_table(request_id)
            if prefix:
                self.pool.incref(prefix.block_ids)
                self.block_tables[self._rows[request_id], : len(prefix.block_ids)] = prefix.block_ids
                table.extend(prefix.block_ids)
                self._num_registered[request_id] = len(prefix.block_ids)
        if num_new <= 0:
            return True
        if len(table) + num_new > self.max_blocks_per_seq:
            raise ValueError(
                f"request {request_id} needs {len(table) + num_new} blocks, "
                f"max is {self.max_blocks_per_seq} (max_model_len)"
            )
        new_ids = self.pool.allocate(num_new)
        row = self._rows[request_id]
        self.block_tables[row, len(table) : len(table) + num_new] = new_ids
        table.extend(new_ids)
        return True

    def allocate_admission(self, request_id: str, prefix: PrefixHit, num_tokens: int, *,
                           num_queried_tokens: int, received: bool = False) -> bool:
        """The table of a request being admitted: the cached blocks of `prefix` (shared),
        then new blocks up to `num_tokens` tokens (none if the prefix covers them); False
        (and no change) if the free blocks are short. Counts the lookup in prefix_stats:
        `num_queried_tokens` looked up, a `received` prompt's (whose KV arrives from
        elsewhere) by blocks."""
        assert request_id not in self._tables, "admission starts a new table"
        if not self.allocate_slots(request_id, max(num_tokens, prefix.num_tokens(self.block_size)), prefix):
            return False
        stats = self.prefix_stats
        if received:
            stats.num_received_blocks_queried += cdiv(num_queried_tokens, self.block_size)
            stats.num_received_blocks_hit += len(prefix.block_ids)
        elif self.enable_prefix_caching:
            stats.num_queried_tokens += num_queried_tokens
            stats.num_hit_tokens += prefix.num_tokens(self.block_size)
        return True

    # ---------------------------------------------------------- prefix cache
    def match_prefix(self, hashes: Sequence[BlockHash]) -> PrefixHit:
        """The cached blocks of the longest run of `hashes` (a request's chain) from its start."""
        if not self.enable_prefix_caching or not hashes:
            return NO_PREFIX
        pool = self.pool
        block_ids = pool.match(hashes)
        return PrefixHit(tuple(block_ids), sum(pool.is_evictable(block_id) for block_id in block_ids))

    def num_blocks_to_admit(self, num_tokens: int, prefix: PrefixHit) -> int:
        """Free blocks a new table of `num_tokens` tokens takes, starting with `prefix`."""
        return cdiv(num_tokens, self.block_size) - len(prefix.block_ids) + prefix.num_evictable

    def cache_blocks(self, request_id: str, hashes: Sequence[BlockHash], num_blocks: int) -> None:
        """Register the request's first `num_blocks` blocks, full and with their KV complete,
        under `hashes` (its chain). A block whose content another block already caches
        stays the request's own."""
        table = self._tables.get(request_id)
        if table is None or not self.enable_prefix_caching:
            return
        start = self._num_registered.get(request_id, 0)
        end = min(num_blocks, len(table))
        register = self.pool.register
        for index in range(start, end):
            register(table[index], hashes[index])
        if end > start:
            self._num_registered[request_id] = end

    def num_registered(self, request_id: str) -> int:
        return self._num_registered.get(request_id, 0)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or not."""
        return self.pool.num_cached

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks nobody holds: free, but their KV is kept until the space is needed."""
        return self.pool.num_evictable

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def get_row(self, request_id: str) -> int:
        return self._rows[request_id]

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def free(self, request_id: str) -> int:
        """Return the request's device blocks to the pool; returns how many."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        self.pool.free(table)
        self._release_table(request_id)
        return len(table)

    def _new_table(self, request_id: str) -> list[int]:
        if not self._free_rows:
            self._grow_rows()
        self._rows[request_id] = self._free_rows.pop()
        table: list[int] = []
        self._tables[request_id] = table
        return table

    def _release_table(self, request_id: str) -> None:
        del self._tables[request_id]
        self._num_registered.pop(request_id, None)
        self._free_rows.append(self._rows.pop(request_id))

    def _grow_rows(self) -> None:
        old = self.block_tables.shape[0]
        grown = np.zeros((old * 2, self.max_blocks_per_seq), dtype=np.int64)
        grown[:old] = self.block_tables
        self.block_tables = grown
        self._free_rows.extend(range(old * 2 - 1, old - 1, -1))

    # ----------------------------------------------------------------- fences
    def fence(self, request_id: str, fence_id: str, start: int = 0) -> int:
        """Take the request's device blocks from `start` on from it without freeing them:
        another process may still be writing into them (a KV transfer whose sender stopped
        answering mid-copy). They stay out of the pool under `fence_id` until
        release_fence(); the blocks before `start` (a cached prefix nobody writes) are
        freed. Returns how many are fenced."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        if fence_id in self._fenced:
            raise ValueError(f"fence {fence_id!r} exists")
        assert self._num_registered.get(request_id, 0) <= start, "a fenced block is cached"
        self._release_table(request_id)
        self.pool.free(table[:start])
        self._fenced[fence_id] = table[start:]
        return len(table) - start

    def release_fence(self, fence_id: str) -> int:
        """Return a fence's blocks to the pool (nothing writes into them any more); how many."""
        table = self._fenced.pop(fence_id, None)
        if table is None:
            return 0
        self.pool.free(table)
        return len(table)

    @property
    def num_fenced_blocks(self) -> int:
        return sum(len(table) for table in self._fenced.values())

    # -------------------------------------------------------------------- swap
    def can_swap_out(self, request_id: str) -> bool:
        return self.swap_pool.can_allocate(len(self._tables.get(request_id, ())))

    def swap_out(self, request_id: str) -> list[BlockCopy]:
        """Move the request's blocks to the swap pool; returns the device->CPU copies to run."""
        table = self._tables[request_id]
        cpu_ids = self.swap_pool.allocate(len(table))
        copies = [BlockCopy(src, dst) for src, dst in zip(table, cpu_ids)]
        self._swapped[request_id] = cpu_ids
        self.free(request_id)
        return copies

    def swap_in(self, request_id: str) -> list[BlockCopy] | None:
        """Bring a swapped request back to device blocks; None (no change) if blocks are short."""
        cpu_ids = self._swapped[request_id]
        if not self.pool.can_allocate(len(cpu_ids)):
            return None
        assert request_id not in self._tables
        table = self._new_table(request_id)
        dev_ids = self.pool.allocate(len(cpu_ids))
        self.block_tables[self._rows[request_id], : len(dev_ids)] = dev_ids
        table.extend(dev_ids)
        copies = [BlockCopy(src, dst) for src, dst in zip(cpu_ids, dev_ids)]
        self.swap_pool.free(cpu_ids)
        del self._swapped[request_id]
        return copies

    def free_swapped(self, request_id: str) -> int:
        cpu_ids = self._swapped.pop(request_id, None)
        if cpu_ids is None:
            return 0
        self.swap_pool.free(cpu_ids)
        return len(cpu_ids)

    # --------------------------------------------------------------- integrity
    def holders(self) -> set[str]:
        return set(self._tables) | set(self._swapped)

    def check_integrity(self) -> None:
        """Every block is free, cached and held by nobody, or held by the tables and fences its
        reference count says; rows and tables agree."""
        held: dict[int, int] = {}
        for request_id, table in self._tables.items():
            row = self._rows[request_id]
            if list(self.block_tables[row, : len(table)]) != table:
                raise AssertionError(f"row {row} of {request_id} disagrees with its table")
            for block_id in table:
                held[block_id] = held.get(block_id, 0) + 1
        for table in self._fenced.values():
            for block_id in table:
                held[block_id] = held.get(block_id, 0) + 1
        self.pool.check_integrity(held)
        swap_held: dict[int, int] = {}
        for cpu_ids in self._swapped.values():
            for block_id in cpu_ids:
                swap_held[block_id] = swap_held.get(block_id, 0) + 1
        self.swap_pool.check_integrity(swap_held)
        if set(self._tables) & set(self._swapped):
            raise AssertionError("a request holds device and swap blocks at once")
        rows = list(self._rows.values()) + self._free_rows
        if sorted(rows) != list(range(self.block_tables.shape[0])):
            raise AssertionError("block-table rows lost or duplicated")
