"""Continuous (iteration-level) admission: waiting requests join the batch at any step."""

from __future__ import annotations

from engine.block_pool import PrefixHit, cdiv
from engine.request import Request
from engine.scheduler.policy import Admission, AdmissionPolicy, AdmissionView, Choices


class ContinuousAdmission(AdmissionPolicy):
    """Admit waiting requests in queue order (WaitingQueue) while their prompt and some growth room fit.

    Admission needs blocks for the request's whole prompt plus a growth reserve
    of `admission_reserve_steps` decode steps for every running sequence, so that
    a newcomer is not preempted right away. Only the first chunk is allocated at
    admission, so the blocks that admitted requests still prefilling will take
    are counted as promised, not free.
    """

    def choose(self, view: AdmissionView, budget: int) -> Choices:
        self.is_kv_short = self.is_seq_capped = False
        waiting = self.waiting
        if not waiting:
            return  # and skip counting promised blocks: a pass over the whole batch
        max_num_seqs = self.config.max_num_seqs
        promised = self.num_promised_blocks(view)
        while waiting and budget > 0 and view.num_seqs < max_num_seqs:
            request = waiting.peek()
            hit = view.prefix.hit(request)  # the one lookup of this admission
            request.num_cached_estimate = hit.num_tokens(view.block_size)
            if not self._can_admit(view, request, hit, promised):
                self.is_kv_short = True
                break  # head-of-line: lower-priority requests do not jump ahead
            waiting.pop()
            budget = yield Admission(request, hit=hit)
            promised += self.blocks_still_to_take(view, request)
        if waiting and view.num_seqs >= max_num_seqs:
            self.is_seq_capped = True

    def _can_admit(self, view: AdmissionView, request: Request, hit: PrefixHit, promised: int) -> bool:
        """Whether the request's whole prompt (and growth room) fits in the unpromised free blocks
        (its cached prefix `hit` takes only the cached blocks nobody holds)."""
        num_blocks = view.kv.num_blocks_to_admit(request.num_tokens, hit)
        available = view.kv.num_free_blocks - promised
        if not view.running and not view.swapped:
            return num_blocks <= available
        reserve = cdiv((len(view.running) + 1) * self.config.admission_reserve_steps, view.block_size)
        return num_blocks + reserve <= available
