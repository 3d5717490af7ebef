"""Block pools and the per-request block tables of the paged KV cache.

Picture of the ownership this module keeps (NOTE: the invariant the property
tests check):

    device BlockPool:  [free list] + [cached, unreferenced (LRU)] + [blocks held]
    swap   BlockPool:  [free list] + [swap blocks of each SWAPPED request]

Every block id is in exactly one of those places. A held block's reference
count is the number of holders: the block tables of requests (several, when a
prefix is shared), and fences. With prefix caching, a full block whose KV is
computed is registered under the hash of its content (engine/kv/prefix_hash.py);
when its last holder lets go it stays cached, counted as free, until an
allocation that finds the free list empty evicts it, least recently used first.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.kv.block_pool import BlockCopy, BlockPool
from engine.kv.host_tier import HostTier, TierHolds
from engine.kv.prefix_hash import BlockHash


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached blocks that start a request's table: the device's `block_ids`, then the host
    tier's `host_block_ids` (engine/kv/host_tier.py: copied into new device blocks), the KV
    of its first (len(block_ids) + len(host_block_ids)) * block_size tokens.
    `num_evictable` of the device blocks are held by nobody now, so taking them takes from
    the free count; `host_hashes` name the host blocks."""

    block_ids: tuple[int, ...]
    num_evictable: int
    host_block_ids: tuple[int, ...] = ()
    host_hashes: tuple[BlockHash, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.block_ids or self.host_block_ids)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + len(self.host_block_ids)

    def num_tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size


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
    # Of the hits, those found in the host tier (engine/kv/host_tier.py).
    num_host_hit_tokens: int = 0
    num_received_blocks_host_hit: int = 0


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
        num_offload_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # The host pool: swap preemption's blocks and the prefix cache's host tier, shared.
        self.swap_pool = BlockPool(num_swap_blocks + num_offload_blocks)
        self.tier = HostTier(self.pool, self.swap_pool) if num_offload_blocks and enable_prefix_caching else None
        self.num_offload_blocks = num_offload_blocks if self.tier is not None else 0
        self.block_tables = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int64)
        self._free_rows: list[int] = list(range(initial_rows - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._rows: dict[str, int] = {}
        self._swapped: dict[str, list[int]] = {}
        # Blocks no request owns that may still be written from outside (see fence()).
        self._fenced: dict[str, list[int]] = {}
        # Free blocks set aside between steps for handed-off requests (set_aside()).
        self._aside: list[int] = []
        # Overlapped steps: blocks freed while a step that may still write into them runs
        # (defer_frees()), and those of a step whose end is awaited (free_deferred()).
        self._deferring = False
        self._deferred: list[int] = []
        self._deferred_before: list[int] = []
        # Prefix caching: how many of each table's leading blocks were offered to the
        # cache (registered, or already cached under another block).
        self._num_registered: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ device
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (not those set aside)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held (those set aside are free, lent out between steps)."""
        return self.pool.num_used - len(self._aside)

    @property
    def num_set_aside(self) -> int:
        return len(self._aside)

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
                self._num_registered[request_id] = prefix.num_blocks
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
        if prefix and prefix.host_block_ids:
            self._reload(new_ids, prefix)
        return True

    def _reload(self, new_ids: list[int], prefix: PrefixHit) -> None:
        """A new table's blocks after its device prefix take the host tier's hit: copied in
        before the next forward pass, and cached on the device under their hashes at once."""
        reloaded = new_ids[:len(prefix.host_block_ids)]
        self.tier.reload(prefix.host_block_ids, reloaded)
        for block_id, block_hash in zip(reloaded, prefix.host_hashes):
            self.pool.register(block_id, block_hash)

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
            stats.num_received_blocks_hit += prefix.num_blocks
            stats.num_received_blocks_host_hit += len(prefix.host_block_ids)
        elif self.enable_prefix_caching:
            stats.num_queried_tokens += num_queried_tokens
            stats.num_hit_tokens += prefix.num_tokens(self.block_size)
            stats.num_host_hit_tokens += len(prefix.host_block_ids) * self.block_size
        return True

    # ---------------------------------------------------------- prefix cache
    def match_prefix(self, hashes: Sequence[BlockHash]) -> PrefixHit:
        """The cached blocks of the longest run of `hashes` (a request's chain) from its start."""
        if not self.enable_prefix_caching or not hashes:
            return NO_PREFIX
        pool = self.pool
        block_ids = pool.match(hashes)
        num_evictable = sum(pool.is_evictable(block_id) for block_id in block_ids)
        if self.tier is None:
            return PrefixHit(tuple(block_ids), num_evictable)
        self.swap_pool.refresh(reversed(hashes[:len(block_ids)]))  # LRU across both tiers, the head last
        rest = hashes[len(block_ids):]
        host_ids = self.tier.match(rest)
        return PrefixHit(tuple(block_ids), num_evictable, tuple(host_ids), tuple(rest[:len(host_ids)]))

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
        register, tier = self.pool.register, self.tier
        for index in range(start, end):
            if register(table[index], hashes[index]) and tier is not None:
                tier.offload(table[index], hashes[index])
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
        if self._deferring:
            self._deferred.extend(table)
        else:
            self.pool.free(table)
        self._release_table(request_id)
        return len(table)

    def truncate(self, request_id: str, num_blocks: int) -> int:
        """Cut the request's table to its first `num_blocks` blocks, freeing the rest (KV of
        tokens it no longer has: rejected speculative proposals). Returns how many."""
        table = self._tables[request_id]
        dropped = table[num_blocks:]
        if not dropped:
            return 0
        assert self._num_registered.get(request_id, 0) <= num_blocks, "a truncated block is cached"
        del table[num_blocks:]
        if self._deferring:
            self._deferred.extend(dropped)
        else:
            self.pool.free(dropped)
        return len(dropped)

    def defer_frees(self, defer: bool) -> None:
        """Overlapped steps: while `defer`, blocks the requests free stay out of the pool, as a
        step launched and still running may write into them (a request that ended has run
        once more), so no transfer from another process may be given them yet. Those
        deferred before this call wait for `free_deferred` (the end of the step they ran
        beside)."""
        self._deferred_before.extend(self._deferred)
        self._deferred = []
        self._deferring = defer

    def free_deferred(self) -> None:
        """Free the blocks deferred before the last `defer_frees`: their step has ended."""
        self.pool.free(self._deferred_before)
        self._deferred_before = []

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

    # --------------------------------------------------------------- host tier
    @property
    def has_tier_copies(self) -> bool:
        """Host-tier copies wait for a step to run them (engine/kv/host_tier.py)."""
        return self.tier is not None and self.tier.has_pending

    def take_tier_copies(self) -> tuple[list[BlockCopy], list[BlockCopy], TierHolds | None]:
        """The host tier's copies for the step being scheduled: (device to host, host to
        device, what the step holds until it has ended: `release_tier_holds`)."""
        if self.tier is None:
            return [], [], None
        return self.tier.take_copies()

    def release_tier_holds(self, holds: TierHolds | None) -> None:
        if holds is not None:
            self.tier.release(holds)

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

    # ------------------------------------------------------------- set aside
    def set_aside(self, num_blocks: int) -> list[int]:
        """Take up to `num_blocks` blocks of the free list (never a cached one, which would
        leave the cache) out of the pool, besides those set aside already; returns them.
        They count as free until `take_aside` gives them to a request or back."""
        block_ids = self.pool.allocate(min(num_blocks, self.pool.num_unused))
        self._aside.extend(block_ids)
        return block_ids

    def take_aside(self, block_ids: Sequence[int], *, to_request: str | None = None,
                   to_fence: str | None = None) -> None:
        """Take blocks set aside: as the new table of `to_request` (in this order), under
        the new fence `to_fence` (something may be writing into them), or back to the pool."""
        taking = set(block_ids)
        kept = [block_id for block_id in self._aside if block_id not in taking]
        assert len(kept) + len(taking) == len(self._aside), "blocks taken that were not set aside"
        assert to_request not in self._tables, "a request takes blocks set aside for a new table"
        if to_fence is not None and to_fence in self._fenced:
            raise ValueError(f"fence {to_fence!r} exists")
        self._aside = kept
        if to_request is not None:
            table = self._new_table(to_request)
            self.block_tables[self._rows[to_request], : len(block_ids)] = block_ids
            table.extend(block_ids)
        elif to_fence is not None:
            self._fenced[to_fence] = list(block_ids)
        else:
            self.pool.free(block_ids)

    # -------------------------------------------------------------------- swap
    def num_kept_blocks(self, request_id: str, limit: int) -> tuple[int, int]:
        """Of the first `limit` blocks of the request's table, the leading ones its readmission
        would find cached if it let go of them now, and how many of those it would copy back:
        (kept, copied). Kept: held by another table too (they stay on the device), or, from
        the first that is not on, kept by the host tier (engine/kv/host_tier.py), as a lookup
        goes on from the device to the host. What a preemption by recompute does not redo."""
        pool, host = self.pool, self.swap_pool if self.tier is not None else None
        passing = collections.Counter(itertools.chain.from_iterable(self._held_apart()))
        kept = copied = 0
        for block_id in self._tables.get(request_id, ())[:limit]:
            block_hash = pool.hash_of(block_id)
            if block_hash is None:
                break
            if not copied and pool.num_holders(block_id) - passing[block_id] > 1:
                kept += 1  # another table's: it stays on the device
            elif host is not None and host.is_cached(block_hash):
                kept, copied = kept + 1, copied + 1
            else:
                break
        return kept, copied

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

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self._swapped.get(request_id, ()))

    def free_swapped(self, request_id: str) -> int:
        cpu_ids = self._swapped.pop(request_id, None)
        if cpu_ids is None:
            return 0
        self.swap_pool.free(cpu_ids)
        return len(cpu_ids)

    # --------------------------------------------------------------- integrity
    def holders(self) -> set[str]:
        return set(self._tables) | set(self._swapped)

    def _held_apart(self) -> tuple[list[int], ...]:
        """Device blocks held by something other than a request's table, a list per holder:
        fences, blocks set aside, frees deferred to a step's end, the host tier's copies."""
        tier_device = self.tier.held()[0] if self.tier is not None else []
        return (*self._fenced.values(), self._aside, self._deferred, self._deferred_before, tier_device)

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
        for table in self._held_apart():
            for block_id in table:
                held[block_id] = held.get(block_id, 0) + 1
        self.pool.check_integrity(held)
        swap_held: dict[int, int] = {}
        tier_host = self.tier.held()[1] if self.tier is not None else []
        for cpu_ids in (*self._swapped.values(), tier_host):
            for block_id in cpu_ids:
                swap_held[block_id] = swap_held.get(block_id, 0) + 1
        self.swap_pool.check_integrity(swap_held)
        if set(self._tables) & set(self._swapped):
            raise AssertionError("a request holds device and swap blocks at once")
        rows = list(self._rows.values()) + self._free_rows
        if sorted(rows) != list(range(self.block_tables.shape[0])):
            raise AssertionError("block-table rows lost or duplicated")
