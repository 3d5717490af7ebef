"""Block pools and the per-request block tables of the paged KV cache.

Picture of the ownership this module keeps (NOTE: the invariant the property
tests check):

    device BlockPool:  [free list] + [block table of each RUNNING request]
    swap   BlockPool:  [free list] + [swap blocks of each SWAPPED request]

Every block id is in exactly one of those places. A block's reference count
is the number of tables holding it (1 today; >1 once blocks are shared, e.g.
by a prefix cache or a KV handoff lease).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


class BlockPool:
    """A free list and reference counts over block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        # LIFO free list: the most recently freed (cache-warm) block is reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (ref count 1 each)."""
        if num_blocks > len(self._free):
            raise MemoryError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        if num_blocks == 0:
            return []
        # Popped from the end, so a fresh pool hands out ascending runs (0, 1, 2, ...):
        # a run of consecutive ids is one contiguous piece of the block-major cache, which
        # a KV transfer moves as one message.
        block_ids = self._free[:-num_blocks - 1:-1]
        del self._free[-num_blocks:]
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a holder to blocks already in use (sharing)."""
        ref_counts = self._ref_counts
        for block_id in block_ids:
            assert ref_counts[block_id] > 0, f"incref of free block {block_id}"
            ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; blocks nobody holds return to the free list."""
        ref_counts = self._ref_counts
        free = self._free
        # Reversed so that a table freed whole is handed out again in the same order.
        for block_id in reversed(list(block_ids)):
            count = ref_counts[block_id]
            assert count > 0, f"double free of block {block_id}"
            ref_counts[block_id] = count - 1
            if count == 1:
                free.append(block_id)

    def check_integrity(self, held: dict[int, int]) -> None:
        """Assert the pool agrees with `held` (block id -> number of holders)."""
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        for block_id in free:
            if self._ref_counts[block_id] != 0 or block_id in held:
                raise AssertionError(f"block {block_id} is free and held")
        for block_id in range(self.num_blocks):
            expected = held.get(block_id, 0)
            if self._ref_counts[block_id] != expected:
                raise AssertionError(
                    f"block {block_id}: ref count {self._ref_counts[block_id]}, held by {expected}"
                )
        if len(free) + len(held) != self.num_blocks:
            raise AssertionError("blocks lost: neither free nor held")


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
    ) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap_blocks)
        self.block_tables = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int64)
        self._free_rows: list[int] = list(range(initial_rows - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._rows: dict[str, int] = {}
        self._swapped: dict[str, list[int]] = {}
        # Blocks no request owns that may still be written from outside (see fence()).
        self._fenced: dict[str, list[int]] = {}

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

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to cover `num_tokens` tokens; False (and no change) if blocks are short."""
        table = self._tables.get(request_id)
        num_new = -(num_tokens // -self.block_size) - (0 if table is None else len(table))
        if num_new > self.pool.num_free:
            return False  # NOTE: an existing table, even an empty one, stays with its request
        if table is None:
            table = self._new_table(request_id)
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
        self._free_rows.append(self._rows.pop(request_id))

    def _grow_rows(self) -> None:
        old = self.block_tables.shape[0]
        grown = np.zeros((old * 2, self.max_blocks_per_seq), dtype=np.int64)
        grown[:old] = self.block_tables
        self.block_tables = grown
        self._free_rows.extend(range(old * 2 - 1, old - 1, -1))

    # ----------------------------------------------------------------- fences
    def fence(self, request_id: str, fence_id: str) -> int:
        """Take the request's device blocks from it without freeing them: another process
        may still be writing into them (a KV transfer whose sender stopped answering
        mid-copy). They stay out of the pool under `fence_id` until release_fence();
        returns how many."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        if fence_id in self._fenced:
            raise ValueError(f"fence {fence_id!r} exists")
        self._release_table(request_id)
        self._fenced[fence_id] = table
        return len(table)

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
        """Every block is free, in exactly one table or in one fence; rows and tables agree."""
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
