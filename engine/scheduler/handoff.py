"""The two states of disaggregated serving, which hold blocks but are not scheduled.

A `prefill_only` request becomes HELD after its first sampled token: its blocks
stay allocated until `release_held` hands them off. A `kv_remote` request (its
prompt's KV computed by another engine) is admitted like any other, but
admission allocates all of its prompt's blocks (those its prefix cache holds
shared, the rest new) and marks it RECEIVING, listed in
`SchedulerOutput.kv_receives`; `complete_kv_receive` then makes it RUNNING with
the prompt computed, or, if the KV never arrived, requeues it to prefill here.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from engine.request import Request, RequestStatus, by_sort_key
from engine.timeline import KvReceived, KvReceiveFailed

if TYPE_CHECKING:
    from engine.block_pool import KVCacheManager
    from engine.scheduler.policy import AdmissionPolicy
    from engine.scheduler.prefix import PrefixMatcher


class KvHandoffStates:
    """The Scheduler's HELD and RECEIVING requests (a part of Scheduler)."""

    held: dict[str, Request]
    receiving: dict[str, Request]
    running: list[Request]
    kv: KVCacheManager
    policy: AdmissionPolicy
    prefix: PrefixMatcher

    if TYPE_CHECKING:
        def finish_request(self, request: Request, status: RequestStatus) -> None: ...

    def release_held(self, request_id: str) -> Request | None:
        """End a HELD request whose KV was handed off (or given up); frees its blocks."""
        request = self.held.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_HANDED_OFF)
        return request

    def complete_kv_receive(self, request_id: str, ok: bool, fence_id: str | None = None) -> Request | None:
        """A RECEIVING request's KV arrived (`ok`) or will not (then it prefills here). With
        `fence_id`, the failed receive's blocks go under that fence (KVCacheManager.fence)."""
        request = self.receiving.get(request_id)
        if request is None:
            return None
        if fence_id is not None:
            assert not ok, "a completed receive has nothing to fence"
            # The reused prefix was never written: only the blocks being received are in doubt.
            self.kv.fence(request_id, fence_id, start=request.num_reused_blocks)
        if request.abort_requested:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
            return None
        del self.receiving[request_id]
        request.kv_remote = False
        if request.events is not None:
            request.record(KvReceived() if ok else KvReceiveFailed())
        if ok:
            request.kv_ready_time = time.monotonic()
            request.num_computed_tokens = request.num_prompt_tokens
            self.prefix.cache_computed(request)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=by_sort_key)
        else:
            self.kv.free(request_id)
            request.status = RequestStatus.WAITING
            self.policy.add(request)
        return request

    def _hold(self, request: Request) -> None:
        """Take a prefilled request out of the batch, keeping its blocks for a handoff."""
        self.running.remove(request)
        request.status = RequestStatus.HELD
        self.held[request.request_id] = request
