"""The scheduler's invariants, checked by tests and debug runs (Scheduler.check_integrity)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.request import PENDING_TOKEN, RequestStatus, by_sort_key

if TYPE_CHECKING:
    from engine.scheduler.stats import SchedulerState


def check_scheduler_integrity(scheduler: SchedulerState) -> None:
    """Each live request is in exactly one queue, and holds exactly the blocks its state allows:
    AssertionError naming the first that does not."""
    scheduler.kv.check_integrity()
    waiting = scheduler.policy.waiting_requests()
    queues = {
        RequestStatus.WAITING: waiting,
        RequestStatus.RUNNING: scheduler.running,
        RequestStatus.SWAPPED: scheduler.swapped,
        RequestStatus.HELD: list(scheduler.handoffs.held.values()),
        RequestStatus.RECEIVING: list(scheduler.handoffs.receiving.values()),
    }
    seen: set[str] = set()
    for status, queue in queues.items():
        for request in queue:
            if request.status != status:
                raise AssertionError(f"{request} is in the {status.name} queue")
            if request.request_id in seen:
                raise AssertionError(f"{request} is queued twice")
            seen.add(request.request_id)
    if seen != set(scheduler.requests):
        raise AssertionError("queues and the request table disagree")
    holders = scheduler.kv.holders()
    for request in scheduler.running:
        if not scheduler.kv.has_blocks(request.request_id):
            raise AssertionError(f"running {request} holds no block table")
        covered = len(scheduler.kv.get_block_ids(request.request_id)) * scheduler.block_size
        if covered < request.num_computed_tokens:
            raise AssertionError(f"{request} has computed tokens outside its blocks")
    for request in waiting:
        if request.request_id in holders or request.num_computed_tokens != 0:
            raise AssertionError(f"waiting {request} holds KV")
    running_ids = {request.request_id for request in scheduler.running}
    swapped_ids = {request.request_id for request in scheduler.swapped}
    handoff_ids = set(scheduler.handoffs.held) | set(scheduler.handoffs.receiving)
    if holders != running_ids | swapped_ids | handoff_ids:
        raise AssertionError(
            "block holders are not exactly the running, swapped, held and receiving requests"
        )
    if scheduler.running != sorted(scheduler.running, key=by_sort_key):
        raise AssertionError("running queue out of priority order")
    if scheduler.num_seqs > scheduler.config.max_num_seqs:
        raise AssertionError("more running sequences than max_num_seqs")
    for request in scheduler.requests.values():
        # Between steps at most one step is in flight: its token, if any, is the last one.
        if PENDING_TOKEN in request.all_token_ids[:-1]:
            raise AssertionError(f"{request} has a pending token before its last")
