"""The prefill side's record of KV held for a handoff: which blocks, until when, and
whether a send is reading them right now."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass


class LeaseState(enum.Enum):
    HELD = "held"  # waiting for a decode worker to pull it
    SENDING = "sending"  # a send reads its blocks right now


@dataclass(slots=True)
class KvLease:
    """One request's held KV. Mutable: the table updates `state` and `release_requested`
    in place, so a sender holding the lease from begin_send sees a release arrive."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    deadline: float  # clock() value after which a HELD lease expires
    state: LeaseState = LeaseState.HELD
    release_requested: bool = False  # released while SENDING: do not retry the send


class KvLeaseTable:
    """Leases by request id, with verb pairs hold/release and begin_send/end_send.

    The table never frees blocks: hold() takes the caller's word that the blocks are
    pinned, and release() / expired() name the requests whose blocks the caller must
    free now; after end_send() the sender frees them. Lifecycle:

        hold ──> HELD ──begin_send──> SENDING ──end_send──> (gone; sender frees)
                  │                      │
                  ├─release──> (gone; caller frees)   release: release_requested = True
                  └─deadline (expired()) ──> (gone; caller frees)

    A SENDING lease never expires: the transfer's own timeout bounds it. Plain Python
    and not thread-safe: one owner (an event loop, say) calls it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[str, KvLease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    @property
    def num_blocks_held(self) -> int:
        """Blocks pinned by all leases, HELD or SENDING."""
        return sum(len(lease.block_ids) for lease in self._leases.values())

    def get(self, request_id: str) -> KvLease | None:
        return self._leases.get(request_id)

    def hold(self, request_id: str, block_ids: list[int], num_tokens: int, lease_s: float) -> KvLease:
        """Record KV pinned for a handoff, HELD for `lease_s` seconds. ValueError if already held."""
        if request_id in self._leases:
            raise ValueError(f"KV of {request_id!r} is already held")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        lease = KvLease(request_id, list(block_ids), num_tokens, self._clock() + lease_s)
        self._leases[request_id] = lease
        return lease

    def begin_send(self, request_id: str) -> KvLease:
        """Pin a HELD lease for a send. KeyError if absent or past its deadline (the next
        expired() sweep removes it); ValueError if a send already has it."""
        lease = self._leases.get(request_id)
        if lease is None:
            raise KeyError(request_id)
        if lease.state is LeaseState.SENDING:
            raise ValueError(f"KV of {request_id!r} is already being sent")
        if lease.deadline <= self._clock():
            raise KeyError(request_id)
        lease.state = LeaseState.SENDING
        return lease

    def end_send(self, request_id: str) -> None:
        """The send finished or failed: the lease is over and the sender frees the blocks.
        KeyError if absent; ValueError if no send had begun."""
        lease = self._leases[request_id]
        if lease.state is not LeaseState.SENDING:
            raise ValueError(f"KV of {request_id!r} is not being sent")
        del self._leases[request_id]

    def release(self, request_id: str) -> bool:
        """Drop a lease. True: it was HELD and is gone, free its blocks now. False: absent
        (nothing to free), or SENDING: marked release_requested, the sender frees after end_send."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        if lease.state is LeaseState.SENDING:
            lease.release_requested = True
            return False
        del self._leases[request_id]
        return True

    def expired(self, now: float) -> list[str]:
        """Remove and return the HELD leases whose deadline is at or before `now`."""
        gone = [
            request_id
            for request_id, lease in self._leases.items()
            if lease.state is LeaseState.HELD and lease.deadline <= now
        ]
        for request_id in gone:
            del self._leases[request_id]
        return gone
