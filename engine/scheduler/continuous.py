"""Continuous (iteration-level) admission: waiting requests join the batch at any step."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.kv.manager import PrefixHit, cdiv
from engine.request import Request
from engine.scheduler.policy import Admission, AdmissionPolicy, AdmissionView, Choices
from engine.scheduler.waiting import WaitingQueue


class ContinuousAdmission(AdmissionPolicy):
    """Admit waiting requests in queue order (WaitingQueue) while their prompt and some growth room fit.

    Admission needs blocks for the request's whole prompt plus a growth reserve
    of `admission_reserve_steps` decode steps for every running sequence, so that
    a newcomer is not preempted right away. Only the first chunk is allocated at
    admission, so the blocks that admitted requests still prefilling will take
    are counted as promised, not free.

    Requests whose prompt's KV another engine computed (kv_remote) wait in a queue
    of their own and are admitted first, whatever the step's token budget: they
    take blocks and no compute, their client has its first token already, and a
    prefill worker holds their KV until they pull it. Behind this worker's own
    prefills, their second token waited seconds (docs/observability.md, "Latency
    by phase": the decode_queue phase). A local request whose aged level is
    better than the received head's goes first all the same, so none starves.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.received = WaitingQueue(config.priority_aging_steps)

    def add(self, request: Request) -> None:
        (self.received if request.kv_remote else self.waiting).push(request)

    def remove(self, request: Request) -> None:
        self.received.remove(request)
        self.waiting.remove(request)

    @property
    def num_waiting(self) -> int:
        return len(self.received) + len(self.waiting)

    def waiting_requests(self) -> list[Request]:
        return [*self.received, *self.waiting]

    def choose(self, view: AdmissionView, budget: int) -> Choices:
        self.is_kv_short = self.is_seq_capped = False
        if not self.received and not self.waiting:
            return  # and skip counting promised blocks: a pass over the whole batch
        max_num_seqs = self.config.max_num_seqs
        promised = self.num_promised_blocks(view)
        while view.num_seqs < max_num_seqs:
            queue = self._next_queue()
            if queue is None or (queue is self.waiting and budget <= 0):
                break
            request = queue.peek()
            hit = view.prefix.hit(request)  # the one lookup of this admission
            request.num_cached_estimate = hit.num_tokens(view.block_size)
            if not self._can_admit(view, request, hit, promised):
                self.is_kv_short = True
                return  # head-of-line: lower-priority requests do not jump ahead
            queue.pop()
            budget = yield Admission(request, hit=hit)
            promised += self.blocks_still_to_take(view, request)
        if (self.received or self.waiting) and view.num_seqs >= max_num_seqs:
            self.is_seq_capped = True

    def landing_room(self, view: AdmissionView) -> int:
        """The free blocks (not cached ones) that admission would not give away before a
        handed-off request arriving now: the next waiting request's whole prompt if it goes
        first (a received one, or a local one aged past the level a handoff of the default
        priority arrives at), growth room for the running batch with one more row, and the
        blocks promised to prompts still prefilling."""
        queue = self._next_queue()
        arriving = view.step_index // self.config.priority_aging_steps
        first = queue is self.received or (queue is self.waiting and queue.head_key()[0] < arriving)
        needed = cdiv(queue.peek().num_tokens, view.block_size) if first else 0
        reserve = cdiv((len(view.running) + 1) * self.config.admission_reserve_steps, view.block_size)
        return view.kv.pool.num_unused - needed - reserve - self.num_promised_blocks(view)

    def _next_queue(self) -> WaitingQueue | None:
        """The queue whose head is next: the received one's, unless the local head's aged
        level is better (it arrived priority_aging_steps or more before); None: both empty."""
        if not self.received or not self.waiting:
            return self.received or self.waiting or None
        return self.waiting if self.waiting.head_key()[0] < self.received.head_key()[0] else self.received

    def _can_admit(self, view: AdmissionView, request: Request, hit: PrefixHit, promised: int) -> bool:
        """Whether the request's whole prompt (and growth room) fits in the unpromised free blocks
        (its cached prefix `hit` takes only the cached blocks nobody holds)."""
        num_blocks = view.kv.num_blocks_to_admit(request.num_tokens, hit)
        available = view.kv.num_free_blocks - promised
        if not view.running and not view.swapped:
            return num_blocks <= available
        reserve = cdiv((len(view.running) + 1) * self.config.admission_reserve_steps, view.block_size)
        return num_blocks + reserve <= available
