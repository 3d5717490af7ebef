"""Static (batch-at-a-time) admission: a new batch forms only when the last one is done."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from engine.kv.manager import cdiv
from engine.request import Request, by_sort_key
from engine.scheduler.policy import Admission, AdmissionPolicy, AdmissionView, Choices

if TYPE_CHECKING:
    from engine.config import SchedulerConfig


class StaticAdmission(AdmissionPolicy):
    """Classic batch-at-a-time serving on the same loop.

    A member is admitted only if its worst case (prompt + max_tokens) fits in the
    free blocks, which it then holds from admission on: a batch that may not be
    broken up cannot preempt, so it must reserve up front, as servers without
    paging do. The reservation, not the token budget, bounds a static batch when
    memory is short; the batch may exceed the token budget (its prompts are then
    prefilled over the next steps). Members preempted from outside (the static
    loop itself never needs to) come back first, into their own batch.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.batch: set[str] = set()  # request ids of the current batch's members
        self.requeued: list[Request] = []  # members preempted by recompute, in running order

    def add(self, request: Request) -> None:
        if request.request_id in self.batch:  # a member whose KV handoff failed: it prefills in its batch
            self.requeue(request)
        else:
            self.waiting.push(request)

    def requeue(self, request: Request) -> None:
        bisect.insort(self.requeued, request, key=by_sort_key)

    def remove(self, request: Request) -> None:
        if request in self.requeued:
            self.requeued.remove(request)
        else:
            self.waiting.remove(request)

    def on_finished(self, request: Request) -> None:
        self.batch.discard(request.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.requeued)

    def waiting_requests(self) -> list[Request]:
        return [*self.waiting, *self.requeued]

    def choose(self, view: AdmissionView, budget: int) -> Choices:
        self.is_kv_short = self.is_seq_capped = False
        max_num_seqs = self.config.max_num_seqs
        requeued = self.requeued
        while requeued and view.num_seqs < max_num_seqs:
            if not self._can_reserve(view, requeued[0]):
                self.is_kv_short = True
                return
            yield Admission(requeued.pop(0), reserve=True)
        if self.batch:
            return
        waiting = self.waiting
        while waiting and view.num_seqs < max_num_seqs:
            request = waiting.peek()
            if not self._can_reserve(view, request):
                self.is_kv_short = True
                break
            waiting.pop()
            self.batch.add(request.request_id)
            yield Admission(request, reserve=True)

    def _can_reserve(self, view: AdmissionView, request: Request) -> bool:
        """Whether the request's worst-case blocks fit in the free blocks."""
        peak = view.peak_kv_tokens(request)
        return cdiv(peak, view.block_size) <= view.kv.num_free_blocks - self.num_promised_blocks(view)
