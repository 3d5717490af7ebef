"""The prefill side's one record of a request's KV handoff: whose it is (the kv_token
that claimed it), which blocks it holds, until when, and whether a send is reading
them right now. (The engine pins the blocks themselves: Scheduler.handoffs.)"""

from __future__ import annotations

import enum
import hmac
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class LeaseState(enum.Enum):
    CLAIMED = "claimed"  # its Prefill runs: the kv_token owns it, nothing is held yet
    HELD = "held"  # waiting for a decode worker to pull it
    SENDING = "sending"  # a send reads its blocks right now


@dataclass(slots=True)
class KvLease:
    """One request's handoff. Mutable: the table updates `state` and `release_requested`
    in place, so a sender holding the lease from begin_send sees a release arrive."""

    request_id: str
    kv_token: str  # only a caller presenting it may release, abort or pull the request
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    deadline: float = math.inf  # clock() value after which a HELD lease expires
    state: LeaseState = LeaseState.CLAIMED
    # Released while CLAIMED (its Prefill still runs: never to be held) or SENDING (do
    # not retry the send).
    release_requested: bool = False
    ends_at_deadline: bool = False  # its request's deadline, not the lease length, ends it


class ReleasedBeforeHeld(KeyError):
    """hold() of a request its owner released while it was being prefilled: nothing is
    held, the lease is gone, and the caller frees the blocks its prefill pinned."""


class KvLeaseTable:
    """Leases by request id, with verb pairs claim/disown, hold/release and begin_send/end_send.

    The table never frees blocks: hold() takes the caller's word that the blocks are
    pinned, and release() / expired() name the requests whose blocks the caller must
    free now; after end_send() the sender frees them. Lifecycle:

        claim ──> CLAIMED ──hold──> HELD ──begin_send──> SENDING ──end_send──> (gone;
                     │                │                      │                   sender frees)
                     │                │                      release: release_requested = True
                     │                ├─release──> (gone; caller frees)
                     │                └─deadline (expired()) ──> (gone; caller frees)
                     ├─release: release_requested = True; a later hold raises
                     │  ReleasedBeforeHeld (the caller frees what its prefill pinned)
                     └─disown──> (gone: nothing held)

    A SENDING lease never expires: the transfer's own timeout bounds it. Plain Python
    and not thread-safe: one owner (an event loop, say) calls it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[str, KvLease] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    @property
    def num_held(self) -> int:
        """Requests whose blocks are held, HELD or SENDING."""
        return sum(lease.state is not LeaseState.CLAIMED for lease in self._leases.values())

    @property
    def num_blocks_held(self) -> int:
        """Blocks pinned by all leases, HELD or SENDING."""
        return sum(len(lease.block_ids) for lease in self._leases.values())

    def get(self, request_id: str) -> KvLease | None:
        return self._leases.get(request_id)

    def owns(self, request_id: str, kv_token: str) -> bool:
        """Whether `kv_token` is the one that claimed the request (compared in constant time)."""
        lease = self._leases.get(request_id)
        return lease is not None and hmac.compare_digest(lease.kv_token.encode(), kv_token.encode())

    def claim(self, request_id: str, kv_token: str) -> KvLease:
        """A Prefill starts: `kv_token` owns the request until its lease ends. ValueError if
        the id is claimed already (being prefilled, held or sent)."""
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} is being prefilled or held here already")
        lease = self._leases[request_id] = KvLease(request_id, kv_token)
        return lease

    def disown(self, request_id: str) -> None:
        """A claimed request's Prefill ended holding nothing: forget it. ValueError if it holds blocks."""
        lease = self._leases.get(request_id)
        if lease is not None and lease.state is not LeaseState.CLAIMED:
            raise ValueError(f"KV of {request_id!r} is held: release it")
        self._leases.pop(request_id, None)

    def hold(self, request_id: str, block_ids: list[int], num_tokens: int, lease_s: float,
             ends_at_deadline: bool = False) -> KvLease:
        """Record a claimed request's KV pinned for a handoff, HELD for `lease_s` seconds.
        KeyError if not claimed (ReleasedBeforeHeld if released since its claim: it is
        gone then, and the caller frees the blocks); ValueError if already held."""
        lease = self._leases[request_id]
        if lease.state is not LeaseState.CLAIMED:
            raise ValueError(f"KV of {request_id!r} is already held")
        if lease.release_requested:  # its owner gave it up mid-prefill: it must not wait a lease out
            del self._leases[request_id]
            raise ReleasedBeforeHeld(request_id)
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        lease.block_ids, lease.num_tokens, lease.deadline = list(block_ids), num_tokens, self._clock() + lease_s
        lease.state, lease.ends_at_deadline = LeaseState.HELD, ends_at_deadline
        return lease

    def begin_send(self, request_id: str) -> KvLease:
        """Pin a HELD lease for a send. KeyError if absent or past its deadline (the next
        expired() sweep removes it); ValueError if a send already has it."""
        lease = self._leases.get(request_id)
        if lease is None or lease.state is LeaseState.CLAIMED:
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
        """Drop a lease. True: it was HELD and is gone, free its blocks now. False: absent;
        CLAIMED (nothing to free yet: marked release_requested, so that its hold refuses);
        or SENDING: marked release_requested, the sender frees after end_send."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        if lease.state is not LeaseState.HELD:
            lease.release_requested = True
            return False
        del self._leases[request_id]
        return True

    def expired(self, now: float) -> list[KvLease]:
        """Remove and return the HELD leases whose deadline is at or before `now`."""
        gone = [lease for lease in self._leases.values() if lease.state is LeaseState.HELD and lease.deadline <= now]
        for lease in gone:
            del self._leases[lease.request_id]
        return gone
