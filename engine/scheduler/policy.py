"""AdmissionPolicy: how waiting requests join the running batch (continuous or static)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from engine.request import Request
from engine.scheduler.waiting import WaitingQueue

if TYPE_CHECKING:
    from engine.scheduler.output import SchedulerOutput
    from engine.scheduler.scheduler import Scheduler


class AdmissionPolicy(ABC):
    """Owns the WAITING requests and decides which of them join the running batch.

    This is where continuous and static batching differ; the rest of a step
    (running requests, swap-ins, preemption) is the Scheduler's. Contract:

    - `add(request)`: a WAITING request holding no blocks waits for admission in
      the place its arrival gave it: a new arrival, or one whose KV handoff failed.
    - `requeue(request)`: the same, for a request preempted by recompute.
    - `remove(request)`: a WAITING request ended (it was aborted).
    - `on_finished(request)`: a request ended, in whatever state.
    - `num_waiting`, `waiting_requests()`: every WAITING request.
    - `admit(out, budget, chunk_cap, now)`: called once per step, after the
      running and swapped requests were served, and only if nothing was
      preempted in the step and no request is swapped out. It moves waiting
      requests into the batch with `Scheduler.admit` (which schedules their
      first chunk into `out`), never past `max_num_seqs` sequences, and returns
      the token budget left. For the step statistics, it sets `is_kv_short` when
      it left a request waiting for KV blocks, and `is_seq_capped` when requests
      wait because `max_num_seqs` sequences already run.

    The base class keeps the waiting requests in one WaitingQueue.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.waiting = WaitingQueue(scheduler.config.priority_aging_steps)
        self.is_kv_short = False
        self.is_seq_capped = False

    @abstractmethod
    def admit(self, out: SchedulerOutput, budget: int, chunk_cap: int, now: float) -> int:
        """Admit waiting requests into this step's batch; returns the token budget left."""

    def add(self, request: Request) -> None:
        self.waiting.push(request)

    def requeue(self, request: Request) -> None:
        self.waiting.push(request)

    def remove(self, request: Request) -> None:
        self.waiting.remove(request)

    def on_finished(self, request: Request) -> None:
        pass

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def waiting_requests(self) -> list[Request]:
        return list(self.waiting)

    def num_promised_blocks(self) -> int:
        """Blocks that running requests still prefilling will take for the rest of their prompt.

        Admission allocates only a request's first chunk, so these are not yet
        off the free list but are no longer free to promise to a newcomer.
        """
        return sum(
            self.blocks_still_to_take(request)
            for request in self.scheduler.running
            if request.num_computed_tokens < len(request.all_token_ids) - 1
        )

    def blocks_still_to_take(self, request: Request) -> int:
        """Blocks the request's table lacks to cover all of its current tokens."""
        return self.scheduler.kv.num_new_blocks(request.request_id, len(request.all_token_ids))
