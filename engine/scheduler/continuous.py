"""Continuous (iteration-level) admission: waiting requests join the batch at any step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.block_pool import PrefixHit, cdiv
from engine.request import Request
from engine.scheduler.policy import AdmissionPolicy

if TYPE_CHECKING:
    from engine.scheduler.output import SchedulerOutput


class ContinuousAdmission(AdmissionPolicy):
    """Admit waiting requests in queue order (WaitingQueue) while their prompt and some growth room fit.

    Admission needs blocks for the request's whole prompt plus a growth reserve
    of `admission_reserve_steps` decode steps for every running sequence, so that
    a newcomer is not preempted right away. Only the first chunk is allocated at
    admission, so the blocks that admitted requests still prefilling will take
    are counted as promised, not free.
    """

    def admit(self, out: SchedulerOutput, budget: int, chunk_cap: int, now: float) -> int:
        self.is_kv_short = self.is_seq_capped = False
        scheduler = self.scheduler
        waiting = self.waiting
        if not waiting:
            return budget  # and skip counting promised blocks: a pass over the whole batch
        max_num_seqs = scheduler.config.max_num_seqs
        promised = self.num_promised_blocks()
        while waiting and budget > 0 and scheduler.num_seqs < max_num_seqs:
            request = waiting.peek()
            hit = scheduler.prefix.hit(request)  # the one lookup of this admission
            request.num_cached_estimate = hit.num_tokens(scheduler.block_size)
            if not self._can_admit(request, hit, promised):
                self.is_kv_short = True
                break  # head-of-line: lower-priority requests do not jump ahead
            waiting.pop()
            budget = scheduler.admit(out, request, budget, chunk_cap, now, hit=hit)
            promised += self.blocks_still_to_take(request)
        if waiting and scheduler.num_seqs >= max_num_seqs:
            self.is_seq_capped = True
        return budget

    def _can_admit(self, request: Request, hit: PrefixHit, promised: int) -> bool:
        """Whether the request's whole prompt (and growth room) fits in the unpromised free blocks
        (its cached prefix `hit` takes only the cached blocks nobody holds)."""
        scheduler = self.scheduler
        num_blocks = scheduler.kv.num_blocks_to_admit(request.num_tokens, hit)
        available = scheduler.kv.num_free_blocks - promised
        if not scheduler.running and not scheduler.swapped:
            return num_blocks <= available
        reserve = cdiv(
            (len(scheduler.running) + 1) * scheduler.config.admission_reserve_steps, scheduler.block_size
        )
        return num_blocks + reserve <= available
