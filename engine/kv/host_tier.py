"""The prefix cache's host tier: the KV of full blocks kept in host memory by the hashes
that name them on the device (engine/kv/prefix_hash.py), and brought back on a hit.

Its blocks are the host pool's: the swap pool (KVCache.swap_blocks), grown by the
offload budget, which swap preemption shares. A swapped request holds its host blocks; a
cached host block nobody holds is evictable, least recently used first, so swapping out
takes the offloaded blocks' room when it needs it and never waits on the tier.

    write-through   a device block registered in the prefix cache (its KV complete) is
                    copied to a host block registered under the same hash, unless the
                    host tier has that hash already. The copy runs at the start of the
                    next step (after the forward pass that computed the block); until
                    that step has ended, the device block and the host block are held
                    by the tier, so neither is handed to anyone who could write into it.
    reload          an admission whose prefix continues, past the device's cached blocks,
                    in the host tier takes new device blocks for those, registered under
                    their hashes at once, and a host-to-device copy of each that runs
                    before the step's forward pass; the host blocks and the device blocks
                    are held until that step has ended (a request that lets go of its
                    table meanwhile, as a failed receive's fence does at once, must not
                    hand a block to a writer the copy could still overwrite).
    never in place  a host block's content changes only after it is evicted (its hash
                    forgotten) and allocated again.

The copies ride on the step's swap copies (SchedulerOutput.swap_out, then swap_in, before
the forward pass, in stream order on CUDA); `TierHolds` goes with the step and is released
when its tokens are back (LLMEngine._complete).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv.block_pool import BlockCopy, BlockPool
from engine.kv.prefix_hash import BlockHash


@dataclass(slots=True, eq=False)
class TierHolds:
    """Blocks the host tier holds until the step that copies them has ended."""

    device_ids: list[int] = field(default_factory=list)
    host_ids: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.device_ids or self.host_ids)


class HostTier:
    """Write-through to, and reloads from, the host pool (see the module's docstring)."""

    def __init__(self, device: BlockPool, host: BlockPool) -> None:
        self.device = device
        self.host = host
        # Device blocks written through so far (its reloads are the prefix cache's host hits:
        # PrefixCacheStats).
        self.num_written = 0
        self.reload_seconds = 0.0  # the reloads' copies, as timed (ModelRunner.finished_copies)
        self._offloads: list[BlockCopy] = []  # device -> host, to run at the next step
        self._reloads: list[BlockCopy] = []  # host -> device, to run at the next step
        self._issued: list[TierHolds] = []  # the holds of steps launched and not yet ended

    @property
    def has_pending(self) -> bool:
        """Copies waiting for a step to run them."""
        return bool(self._offloads or self._reloads)

    def match(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The host blocks of the longest run of `hashes` from its start."""
        return self.host.match(hashes)

    def offload(self, device_id: int, block_hash: BlockHash) -> None:
        """Write a device block just registered under `block_hash` through to the host tier
        (nothing if it holds that hash already, or every host block is held)."""
        host = self.host
        if host.is_cached(block_hash):
            host.refresh([block_hash])
            return
        if not host.num_free:
            return
        [host_id] = host.allocate(1)
        host.register(host_id, block_hash)
        self.device.incref([device_id])
        self._offloads.append(BlockCopy(device_id, host_id))

    def reload(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> None:
        """Copy host blocks (cached) into new device blocks before the next forward pass."""
        self.host.incref(host_ids)
        self.device.incref(device_ids)
        self._reloads.extend(BlockCopy(src, dst) for src, dst in zip(host_ids, device_ids))

    def take_copies(self) -> tuple[list[BlockCopy], list[BlockCopy], TierHolds]:
        """The copies the step being scheduled runs (offloads, reloads), and what it holds
        until it has ended (`release`)."""
        offloads, reloads = self._offloads, self._reloads
        self._offloads, self._reloads = [], []
        holds = _holds(offloads, reloads)
        self.num_written += len(offloads)
        if holds:
            self._issued.append(holds)
        return offloads, reloads, holds

    def release(self, holds: TierHolds) -> None:
        """A step that ran the tier's copies has ended: its blocks are the pools' again."""
        if not holds:
            return
        self._issued.remove(holds)
        self.device.free(holds.device_ids)
        self.host.free(holds.host_ids)

    def held(self) -> tuple[list[int], list[int]]:
        """(device blocks, host blocks) the tier holds now, one entry per hold."""
        pending = _holds(self._offloads, self._reloads)
        device, host = pending.device_ids, pending.host_ids
        for holds in self._issued:
            device += holds.device_ids
            host += holds.host_ids
        return device, host


def _holds(offloads: list[BlockCopy], reloads: list[BlockCopy]) -> TierHolds:
    """What copies hold: each copy's device block and host block."""
    return TierHolds([copy.src for copy in offloads] + [copy.dst for copy in reloads],
                     [copy.dst for copy in offloads] + [copy.src for copy in reloads])
