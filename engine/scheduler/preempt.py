"""Preemption: a running request gives up its device blocks (Scheduler._preempt)."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Protocol

from engine.request import Request, RequestStatus, by_sort_key
from engine.scheduler.preemption import PreemptionKind
from engine.timeline import Preempted

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.kv.manager import KVCacheManager
    from engine.scheduler.output import SchedulerOutput
    from engine.scheduler.policy import AdmissionPolicy
    from engine.scheduler.preemption import PreemptionCostModel
    from engine.scheduler.stats import SchedulerCounters


class Preempting(Protocol):
    """What preemption changes of the scheduler (the Scheduler is one)."""

    config: SchedulerConfig
    kv: KVCacheManager
    cost_model: PreemptionCostModel
    policy: AdmissionPolicy
    running: list[Request]
    swapped: list[Request]
    counters: SchedulerCounters


def preempt(scheduler: Preempting, request: Request, out: SchedulerOutput) -> None:
    """Take `request` out of the running batch to free its blocks: swapped out to CPU, or
    dropped to recompute later (back in the queue), as the preemption mode and the cost
    model choose."""
    mode = scheduler.config.preemption_mode
    kv = scheduler.kv
    request_id = request.request_id
    kind = PreemptionKind.RECOMPUTE
    if mode != "recompute" and kv.can_swap_out(request_id):
        if mode == "swap":
            kind = PreemptionKind.SWAP
        else:
            # What the readmission's lookup would find (prefix.py: none when prompt logprobs are due).
            kept = (0, 0) if request.prompt_logprobs is not None else kv.num_kept_blocks(
                request_id, (request.num_tokens - 1) // kv.block_size)
            kind = scheduler.cost_model.choose(request.num_computed_tokens, len(kv.get_block_ids(request_id)),
                                               kept, kv.block_size)
    if request.events is not None:
        request.record(Preempted(kind=kind, num_blocks=len(kv.get_block_ids(request_id)),
                                 num_computed_tokens=request.num_computed_tokens))
    scheduler.running.remove(request)
    request.spec_token_ids = []
    request.num_preemptions += 1
    out.preempted.append((request, kind))
    if kind is PreemptionKind.SWAP:
        copies = kv.swap_out(request_id)
        out.swap_out.extend(copies)
        scheduler.counters.record_preemption(kind, len(copies))
        request.status = RequestStatus.SWAPPED
        bisect.insort(scheduler.swapped, request, key=by_sort_key)
    else:
        scheduler.counters.record_preemption(kind)
        kv.free(request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        scheduler.policy.requeue(request)
