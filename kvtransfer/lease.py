"""The prefill side's record of KV held for a handoff: what is held, until when, and
whether a send is using it right now."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass


class LeaseState(enum.Enum):
    HELD = "held"  # waiting for a decode worker to pull it
    SENDING = "sending"  # a send reads its blocks right now


@dataclass
class KvLease:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    deadline: float  # time.monotonic() after which a HELD lease expires
    state: LeaseState = LeaseState.HELD
    release_requested: bool = False


class KvLeaseTable:
    """Leases by request id. The table never frees blocks itself: its verbs tell the
    caller which requests' blocks to free. Not thread-safe (the event loop owns it)."""

    def __init__(self) -> None:
        self._leases: dict[str, KvLease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    @property
    def num_blocks_held(self) -> int:
        return sum(len(lease.block_ids) for lease in self._leases.values())

    def hold(self, request_id: str, block_ids: list[int], num_tokens: int, lease_s: float) -> KvLease:
        if request_id in self._leases:
            raise ValueError(f"KV of {request_id!r} is already held")
        lease = KvLease(request_id, list(block_ids), num_tokens, time.monotonic() + lease_s)
        self._leases[request_id] = lease
        return lease

    def begin_send(self, request_id: str) -> KvLease:
        """Pin a HELD lease for a send. KeyError if absent; ValueError if already sending."""
        lease = self._leases[request_id]
        if lease.state is LeaseState.SENDING:
            raise ValueError(f"KV of {request_id!r} is already being sent")
        lease.state = LeaseState.SENDING
        return lease

    def end_send(self, request_id: str) -> None:
        """The send finished (or failed): the lease is over; the caller frees the blocks."""
        self._leases.pop(request_id, None)

    def release(self, request_id: str) -> bool:
        """Give up a lease. True: it was HELD and is gone, free its blocks now. False: absent,
        or SENDING (then the send's end frees them)."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        if lease.state is LeaseState.SENDING:
            lease.release_requested = True
            return False
        del self._leases[request_id]
        return True

    def expired(self, now: float) -> list[str]:
        """Remove and return the HELD leases past their deadline (a send has its own timeout)."""
        gone = [
            request_id
            for request_id, lease in self._leases.items()
            if lease.state is LeaseState.HELD and lease.deadline <= now
        ]
        for request_id in gone:
            del self._leases[request_id]
        return gone
