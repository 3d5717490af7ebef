"""AdmissionPolicy: which waiting requests join the running batch (continuous or static).

A policy only chooses. It owns the WAITING requests and, once per step, yields the
ones to admit, in order; the Scheduler starts each running (Scheduler.start_running schedules its
first chunk) before asking for the next, so a policy sees every admission's blocks
and budget before it decides on the one after. What it reads of the scheduler is
an AdmissionView, passed to each call and never changed by the policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.request import Request
from engine.scheduler.waiting import WaitingQueue

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.kv.manager import KVCacheManager, PrefixHit
    from engine.scheduler.prefix import PrefixMatcher


class AdmissionView(Protocol):
    """What a policy reads of the scheduler to choose (the Scheduler is one)."""

    kv: KVCacheManager
    prefix: PrefixMatcher
    running: list[Request]
    swapped: list[Request]
    block_size: int

    @property
    def num_seqs(self) -> int: ...

    @property
    def step_index(self) -> int: ...

    def peak_kv_tokens(self, request: Request) -> int: ...



@dataclass(frozen=True, slots=True)
class Admission:
    """A waiting request a policy chose, taken off its queue: admit it now."""

    request: Request
    reserve: bool = False  # take its worst-case blocks at admission
    hit: PrefixHit | None = None  # its prefix lookup, if the policy made one to decide


# What `choose` is: it yields Admissions and is sent the token budget left after each.
Choices = Generator[Admission, int, None]


class AdmissionPolicy(ABC):
    """Owns the WAITING requests and chooses which of them join the running batch.

    This is where continuous and static batching differ; the rest of a step
    (running requests, swap-ins, preemption) is the Scheduler's. Contract:

    - `add(request)`: a WAITING request holding no blocks waits for admission in
      the place its arrival gave it: a new arrival, or one whose KV handoff failed.
    - `requeue(request)`: the same, for a request preempted by recompute.
    - `remove(request)`: a WAITING request ended (it was aborted).
    - `on_finished(request)`: a request ended, in whatever state.
    - `num_waiting`, `waiting_requests()`: every WAITING request.
    - `choose(view, budget)`: called once per step, after the running and swapped
      requests were served, and only if nothing was preempted in the step and no
      request is swapped out. It yields the requests to admit, each taken off the
      queue, never past `max_num_seqs` sequences, and is sent the token budget left
      after each admission. For the step statistics, it sets `is_kv_short` when it
      left a request waiting for KV blocks, and `is_seq_capped` when requests wait
      because `max_num_seqs` sequences already run.

    The base class keeps the waiting requests in one WaitingQueue (continuous
    admission adds a second, for handed-off requests).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting = WaitingQueue(config.priority_aging_steps)
        self.is_kv_short = False
        self.is_seq_capped = False

    @abstractmethod
    def choose(self, view: AdmissionView, budget: int) -> Choices:
        """The waiting requests to admit into this step's batch, in order."""

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

    def landing_room(self, view: AdmissionView) -> int:
        """Free blocks that handed-off requests may take at once as they arrive while the
        step runs (engine/kv/landing.py): none here; continuous admission allows some."""
        return 0

    def waiting_requests(self) -> list[Request]:
        return list(self.waiting)

    @staticmethod
    def num_promised_blocks(view: AdmissionView) -> int:
        """Blocks that running requests still prefilling will take for the rest of their prompt.

        Admission allocates only a request's first chunk, so these are not yet
        off the free list but are no longer free to promise to a newcomer.
        """
        return sum(
            AdmissionPolicy.blocks_still_to_take(view, request)
            for request in view.running
            if request.is_prefilling
        )

    @staticmethod
    def blocks_still_to_take(view: AdmissionView, request: Request) -> int:
        """Blocks the request's table lacks to cover all of its current tokens."""
        return view.kv.num_new_blocks(request.request_id, len(request.all_token_ids))
