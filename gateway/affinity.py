"""Prefix affinity: which worker's prefix cache likely holds a prompt's first blocks.

Each worker names its cached KV blocks by a hash chain over their tokens
(engine/kv/prefix_hash.py). The gateway computes the same chain for every prompt
it routes and remembers, per worker, the block hashes it sent there, least
recently used first, up to the worker's cache size in blocks: an estimate of
that worker's cache, kept without asking it (its own eviction order is the same
LRU over the same traffic, seen from one gateway). The routing choice
(gateway/workers.py) weighs what a worker likely holds against its load, in
the same units: prefill tokens saved against prefill tokens queued, KV blocks
not transferred against free blocks.

A worker with a host tier (engine/kv/host_tier.py) keeps what its device cache evicts in
host memory: the blocks pushed out of the estimate's device part go on in a host part, up
to the tier's size, and a prompt's run continues there. Those blocks are copied back, not
computed, nor moved by a handoff, but they take device blocks again: the prefill side
counts them weighted by what a copy saves against a recompute (Worker.cached_prefill_tokens),
the decode side not as free blocks.

The estimate is forgotten when a worker restarts (a new worker id) or turns
prefix caching off, and when it is lost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.kv.prefix_hash import BlockHash, extend_block_hashes


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
    """The block hashes one worker was sent, most recently used last: the latest `capacity`
    in its device cache, and up to the latest `host_capacity` in its host tier."""

    __slots__ = ("_blocks", "_host", "capacity", "host_capacity", "worker_id")

    def __init__(self) -> None:
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self._host: OrderedDict[BlockHash, None] = OrderedDict()
        self.capacity = 0  # 0: the worker caches nothing (or is not known yet)
        self.host_capacity = 0
        self.worker_id = ""

    def __len__(self) -> int:
        return len(self._blocks) + len(self._host)

    def sync(self, worker_id: str, caching: bool, num_blocks: int, num_host_blocks: int = 0) -> None:
        """Follow a poll: a restarted worker (new id) or one that does not cache holds nothing."""
        if worker_id != self.worker_id or not caching:
            self.clear()
        self.worker_id = worker_id
        self.capacity = num_blocks if caching else 0
        self.host_capacity = num_host_blocks if caching else 0
        self._trim()

    def clear(self) -> None:
        self._blocks.clear()
        self._host.clear()

    def matched(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, the worker's device cache likely holds."""
        return self.matched_tiers(hashes)[0]

    def matched_tiers(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """How many of `hashes`, from the first, the worker likely holds: in its device cache,
        then, going on, in its host tier (as the worker matches them)."""
        blocks, host = self._blocks, self._host
        device = count = 0
        for block_hash in hashes:
            if block_hash in blocks and count == device:
                device += 1
            elif block_hash not in host:
                break
            count += 1
        return device, count - device

    def add(self, hashes: Sequence[BlockHash]) -> None:
        """The worker was sent these blocks (a chain from its start): they are its most recent."""
        if not self.capacity:
            return
        blocks, host = self._blocks, self._host
        # The chain's head last: a worker's cache evicts a chain's tail before its head.
        for block_hash in reversed(hashes):
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
            host.pop(block_hash, None)
        self._trim()

    def _trim(self) -> None:
        """The device part's least recently used go on in the host part, whose own least
        recently used are forgotten. The worker's host tier holds copies of its device's
        blocks too (written through), so it holds host_capacity - capacity blocks more."""
        blocks, host = self._blocks, self._host
        while len(blocks) > self.capacity:
            block_hash, _ = blocks.popitem(last=False)
            host[block_hash] = None
        while len(host) > max(0, self.host_capacity - self.capacity):
            host.popitem(last=False)
