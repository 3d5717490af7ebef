"""KvHandoffs: the two states of disaggregated serving, which hold blocks but are not
scheduled; a component the Scheduler owns and calls.

A `prefill_only` request becomes HELD after its first sampled token: its blocks
stay allocated until the Scheduler's `release_held` ends it (handed off). A
`kv_remote` request (its prompt's KV computed by another engine) is admitted like
any other, but admission allocates all of its prompt's blocks (those its prefix
cache holds shared, the rest new) and marks it RECEIVING, listed in
`SchedulerOutput.kv_receives`; the Scheduler's `complete_kv_receive` then makes it
RUNNING with the prompt computed, or, if the KV never arrived, requeues it to
prefill here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.request import Request, RequestStatus
from engine.timeline import KvReceived, KvReceiveFailed

if TYPE_CHECKING:
    from engine.kv.landing import Landing
    from engine.kv.manager import KVCacheManager
    from engine.scheduler.prefix import PrefixMatcher


class KvHandoffs:
    """The HELD requests (blocks kept for another engine to pull) and the RECEIVING ones
    (blocks being filled by another engine), by request id."""

    def __init__(self, kv: KVCacheManager, prefix: PrefixMatcher) -> None:
        self.kv = kv
        self.prefix = prefix
        self.held: dict[str, Request] = {}
        self.receiving: dict[str, Request] = {}
        self.num_landed = 0  # requests that landed (land())

    def hold(self, request: Request) -> None:
        """A prefilled request out of the batch: its blocks kept for a handoff."""
        request.status = RequestStatus.HELD
        self.held[request.request_id] = request

    def land(self, request: Request, landing: Landing) -> None:
        """A kv_remote request RECEIVING at once in the blocks set aside that it claimed,
        its table now (engine/kv/landing.py)."""
        self.kv.prefix_stats.num_received_blocks_queried += len(landing.block_ids)
        request.landing = landing.ticket
        request.status = RequestStatus.RECEIVING
        self.num_landed += 1
        self.receive(request)

    def receive(self, request: Request) -> None:
        """An admitted kv_remote request, its prompt's blocks allocated, waits for its KV."""
        self.receiving[request.request_id] = request

    def forget(self, request: Request) -> None:
        """A HELD or RECEIVING request ended: out of its state, its blocks freed."""
        states = self.held if request.status == RequestStatus.HELD else self.receiving
        del states[request.request_id]
        self.kv.free(request.request_id)

    def end_receive(self, request: Request, ok: bool) -> None:
        """A RECEIVING request's KV arrived (`ok`: RUNNING, its prompt computed and offered
        to the prefix cache) or will not (WAITING, its blocks freed, to prefill here); the
        Scheduler then puts it in its queue."""
        del self.receiving[request.request_id]
        request.kv_remote = False
        if request.events is not None:
            request.record(KvReceived() if ok else KvReceiveFailed())
        if ok:
            request.kv_ready_time = time.monotonic()
            request.num_computed_tokens = request.num_prompt_tokens
            self.prefix.cache_computed(request)
            request.status = RequestStatus.RUNNING
        else:
            self.kv.free(request.request_id)
            request.status = RequestStatus.WAITING
