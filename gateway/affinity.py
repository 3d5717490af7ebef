"""Prefix affinity: which worker's prefix cache likely holds a prompt's first blocks.

Each worker names its cached KV blocks by a hash chain over their tokens
(engine/prefix_hash.py). The gateway computes the same chain for every prompt
it routes and remembers, per worker, the block hashes it sent there, least
recently used first, up to the worker's cache size in blocks: an estimate of
that worker's cache, kept without asking it (its own eviction order is the same
LRU over the same traffic, seen from one gateway). The routing choice
(gateway/workers.py) weighs what a worker likely holds against its load, in
the same units: prefill tokens saved against prefill tokens queued, KV blocks
not transferred against free blocks.

The estimate is forgotten when a worker restarts (a new worker id) or turns
prefix caching off, and when it is lost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.prefix_hash import BlockHash, extend_block_hashes


class PromptBlocks:
    """A request's tokens and their block hash chain, per block size (workers may differ),
    computed once for each."""

    __slots__ = ("token_ids", "_hashes")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._hashes: dict[int, list[BlockHash]] = {}

    def hashes(self, block_size: int) -> list[BlockHash]:
        """The hashes of every full block of the tokens."""
        hashes = self._hashes.setdefault(block_size, [])
        return extend_block_hashes(hashes, self.token_ids, block_size, len(self.token_ids) // block_size)

    def extended(self, token_ids: Sequence[int]) -> PromptBlocks:
        """These tokens followed by `token_ids`: the chains hashed so far carry over (their
        blocks are a prefix of the longer sequence's), only the new blocks are hashed."""
        longer = PromptBlocks([*self.token_ids, *token_ids])
        longer._hashes = {block_size: list(hashes) for block_size, hashes in self._hashes.items()}
        return longer


class PrefixIndex:
    """The block hashes one worker was sent, most recently used last, at most `capacity`."""

    __slots__ = ("_blocks", "capacity", "worker_id")

    def __init__(self) -> None:
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self.capacity = 0  # 0: the worker caches nothing (or is not known yet)
        self.worker_id = ""

    def __len__(self) -> int:
        return len(self._blocks)

    def sync(self, worker_id: str, caching: bool, num_blocks: int) -> None:
        """Follow a poll: a restarted worker (new id) or one that does not cache holds nothing."""
        if worker_id != self.worker_id or not caching:
            self._blocks.clear()
        self.worker_id = worker_id
        self.capacity = num_blocks if caching else 0
        self._trim()

    def clear(self) -> None:
        self._blocks.clear()

    def matched(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, the worker likely holds."""
        blocks = self._blocks
        count = 0
        for block_hash in hashes:
            if block_hash not in blocks:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[BlockHash]) -> None:
        """The worker was sent these blocks (a chain from its start): they are its most recent."""
        if not self.capacity:
            return
        blocks = self._blocks
        # The chain's head last: a worker's cache evicts a chain's tail before its head.
        for block_hash in reversed(hashes):
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        self._trim()

    def _trim(self) -> None:
        blocks = self._blocks
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
