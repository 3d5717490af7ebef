"""Token-budget, iteration-level scheduler with chunked prefill and preemption.

One loop, no prefill/decode phases: each step every request's
`num_computed_tokens` catches up with its `num_tokens` as far as the step's
token budget allows. Order of service within a step:

    1. RUNNING requests, highest priority first: one token when decoding, a
       chunk when prefilling. A request whose table cannot grow preempts the
       lowest-priority, most recently admitted running request (possibly
       itself) by recompute or swap, whichever the cost model finds cheaper.
    2. SWAPPED requests come back if nothing was preempted this step.
    3. WAITING requests are admitted by priority with aging, if nothing was
       preempted this step and their whole prompt plus a few decode steps of
       growth fits in the free blocks.

Disaggregated serving adds two states that hold blocks but are not
scheduled. A `prefill_only` request becomes HELD after its first sampled
token: its blocks stay allocated until `release_held` hands them off. A
`kv_remote` request (its prompt's KV computed by another engine) is admitted
like any other, but admission allocates all of its prompt's blocks and marks
it RECEIVING, listed in `SchedulerOutput.kv_receives`; `complete_kv_receive`
then makes it RUNNING with the prompt computed, or, if the KV never arrived,
requeues it to prefill here.

The "static" policy is classic batch-at-a-time serving on the same loop: a new
batch forms only when every member of the previous one has finished, and a
member is admitted only if its worst case (prompt plus max_tokens) fits in the
free blocks, which it holds from admission on. A batch that may not be broken
up cannot preempt, so it must reserve up front, as servers without paging do;
the reservation is what bounds a static batch when memory is short.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockCopy, KVCacheManager, cdiv
from engine.config import SchedulerConfig
from engine.preemption import PreemptionCostModel, PreemptionKind
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    """What to run in one step.

    `requests[i]` gets `num_scheduled_tokens[i]` tokens of work, starting at its
    `num_computed_tokens`. The runner runs `swap_out` copies, then `swap_in`
    copies, then the forward pass (freed blocks may be reused in the same step).
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    swap_out: list[BlockCopy] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)
    preempted: list[tuple[Request, PreemptionKind]] = field(default_factory=list)
    # Requests admitted this step whose prompt KV must now be received into their blocks.
    kv_receives: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.swap_out and not self.swap_in


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the scheduler's counters (see Scheduler.stats)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_held: int  # KV held for a handoff (prefill side)
    num_receiving: int  # blocks allocated, KV arriving (decode side)
    num_queued_prefill_tokens: int  # prompt tokens admitted or waiting, not yet computed
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    num_swap_blocks_total: int
    num_swap_blocks_used: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_swapped_blocks_out: int
    num_steps: int
    num_tokens_last_step: int
    num_tokens_scheduled_total: int
    mean_tokens_per_step: float
    mean_seqs_per_step: float
    kv_memory_efficiency: float
    num_finished: int
    mean_queue_time: float
    queue_times: tuple[float, ...]
    recent: RecentStats
    oldest_queued_time: float  # seconds the longest-waiting never-admitted request has waited (0: none)


@dataclass(frozen=True, slots=True)
class RecentStats:
    """What the scheduler did over its recent steps: the last `window_s` seconds, or
    fewer steps if it has been idle (steps happen only while there is work)."""

    window_s: float
    seconds: float  # from the window's first step to its last
    seconds_since_last_step: float  # inf: no step yet
    num_steps: int
    mean_batch_size: float  # sequences per step
    mean_tokens_per_step: float
    mean_kv_usage: float  # fraction of KV blocks in use after each step
    mean_num_waiting: float  # requests left waiting after each step
    num_admissions: int  # entries into the running batch: admissions, readmissions, swap-ins
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_swapped_blocks_out: int
    num_queued: int  # requests admitted for the first time
    mean_queue_time: float  # their mean arrival-to-admission time
    # Steps that ended with requests waiting because KV blocks were short (admission
    # refused for lack of free blocks, or held back by a preemption or swapped requests),
    # and because max_num_seqs sequences were already running.
    num_steps_kv_blocked: int
    num_steps_seq_capped: int

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    @property
    def preemption_rate(self) -> float:
        """Preemptions per entry into the running batch."""
        return self.num_preemptions / self.num_admissions if self.num_admissions else 0.0

    @property
    def mean_swap_blocks(self) -> float:
        """Blocks moved out per swap preemption."""
        return self.num_swapped_blocks_out / self.num_preemptions_swap if self.num_preemptions_swap else 0.0


# Cumulative counters snapshotted after every step, for RecentStats (see Scheduler._totals).
_TOTALS = ("steps", "seqs", "tokens", "kv_used", "waiting", "admissions", "preempt_recompute",
           "preempt_swap", "swap_blocks", "queued", "queue_time", "kv_blocked", "seq_capped")
RECENT_WINDOW_S = 60.0
_MAX_RECENT_STEPS = 1 << 16


class Scheduler:
    """Owns the request queues and decides each step's work."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        cost_model: PreemptionCostModel,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.kv = kv
        self.cost_model = cost_model
        self.max_model_len = max_model_len
        self.block_size = kv.block_size
        self.requests: dict[str, Request] = {}
        # Heap of (aging key, arrival sequence, request). Aging makes a request's
        # effective priority `priority - waited_steps / aging_steps`; ordering by
        # `priority * aging_steps + arrival_step` is the same order at every step.
        self._waiting: list[tuple[int, int, Request]] = []
        self.running: list[Request] = []  # sorted by Request.sort_key
        self.swapped: list[Request] = []  # sorted by Request.sort_key
        self.held: dict[str, Request] = {}
        self.receiving: dict[str, Request] = {}
        self._num_arrivals = 0
        self._num_admissions = 0
        self.step_index = 0
        self._is_static = config.policy == "static"
        self._static_batch: set[str] = set()
        self._static_requeue: list[Request] = []  # batch members preempted by recompute
        # Counters.
        self.num_preemptions = {PreemptionKind.RECOMPUTE: 0, PreemptionKind.SWAP: 0}
        self.num_swapped_blocks_out = 0
        self.num_tokens_last_step = 0
        self.num_tokens_total = 0
        self._num_seqs_total = 0
        self._kv_efficiency_total = 0.0
        self._num_finished = 0
        self._queue_time_total = 0.0
        self.queue_times: list[float] = []
        self._num_entries = 0  # admissions, readmissions and swap-ins
        self._kv_used_total = 0
        self._waiting_total = 0
        self._num_steps_kv_blocked = 0
        self._num_steps_seq_capped = 0
        # This step left requests waiting for KV blocks / at the max_num_seqs cap.
        self._step_blocked_by_kv = False
        self._step_seq_capped = False
        # (time, totals) after each step of the recent window; the first is its baseline.
        self._recent: deque[tuple[float, tuple]] = deque(maxlen=_MAX_RECENT_STEPS)
        self._recent.append((time.monotonic(), self._totals()))

    # ------------------------------------------------------------- requests
    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._static_requeue)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Whether a step could do any work (HELD and RECEIVING requests wait on others)."""
        return bool(self.running or self.swapped or self._waiting or self._static_requeue)

    @property
    def _num_seqs(self) -> int:
        """Sequences counted against max_num_seqs: running, and receiving (about to run)."""
        return len(self.running) + len(self.receiving)

    def peak_kv_tokens(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The most tokens a request ever holds in the KV cache.

        The last sampled token ends the request before its KV is computed.
        """
        return min(num_prompt_tokens + max_tokens, self.max_model_len) - 1

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError for a request that could never run here."""
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens; max_model_len is {self.max_model_len}"
            )
        peak_tokens = self.peak_kv_tokens(num_prompt_tokens, max_tokens)
        if cdiv(peak_tokens, self.block_size) > self.kv.pool.num_blocks:
            raise ValueError(
                f"request needs up to {cdiv(peak_tokens, self.block_size)} KV blocks; "
                f"the cache has {self.kv.pool.num_blocks}"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.check_admissible(request.num_prompt_tokens, request.sampling_params.max_tokens)
        request.arrival_step = self.step_index
        request.arrival_index = self._num_arrivals
        self._num_arrivals += 1
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        key = request.priority * self.config.priority_aging_steps + request.arrival_step
        heapq.heappush(self._waiting, (key, request.arrival_index, request))

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state and free everything it holds."""
        assert status.is_finished
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.free(request.request_id)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.kv.free_swapped(request.request_id)
        elif request.status in (RequestStatus.HELD, RequestStatus.RECEIVING):
            queue = self.held if request.status == RequestStatus.HELD else self.receiving
            del queue[request.request_id]
            self.kv.free(request.request_id)
        elif request in self._static_requeue:
            self._static_requeue.remove(request)
        else:
            self._waiting = [entry for entry in self._waiting if entry[2] is not request]
            heapq.heapify(self._waiting)
        request.status = status
        request.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)
        self._static_batch.discard(request.request_id)
        self._num_finished += 1

    def abort_request(self, request_id: str) -> Request | None:
        """End a request. A RECEIVING one keeps its blocks until `complete_kv_receive`:
        its KV may be being written into them right now."""
        request = self.requests.get(request_id)
        if request is None or request.abort_requested:
            return None
        if request.status == RequestStatus.RECEIVING:
            request.abort_requested = True
        else:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    # ------------------------------------------------------------ KV handoff
    def release_held(self, request_id: str) -> Request | None:
        """End a HELD request whose KV was handed off (or given up); frees its blocks."""
        request = self.held.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_HANDED_OFF)
        return request

    def complete_kv_receive(self, request_id: str, ok: bool) -> Request | None:
        """A RECEIVING request's KV arrived (`ok`) or will not (then it prefills here)."""
        request = self.receiving.get(request_id)
        if request is None:
            return None
        if request.abort_requested:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
            return None
        del self.receiving[request_id]
        request.kv_remote = False
        if request.events is not None:
            request.record("kv_received" if ok else "kv_receive_failed", {})
        if ok:
            request.kv_ready_time = time.monotonic()
            request.num_computed_tokens = request.num_prompt_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_sort_key)
        else:
            self.kv.free(request_id)
            request.status = RequestStatus.WAITING
            self._push_waiting(request)
        return request

    # ------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        config = self.config
        budget = config.max_num_batched_tokens
        chunk_cap = config.long_prefill_token_threshold or budget
        kv = self.kv
        running = self.running
        requests = out.requests
        num_scheduled = out.num_scheduled_tokens

        # 1. Running requests, highest priority first.
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = len(request.all_token_ids) - request.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if num_new > chunk_cap:
                num_new = chunk_cap
            if num_new <= 0:
                i += 1
                continue
            while not kv.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new
            ):
                victim = running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                requests.append(request)
                num_scheduled.append(num_new)
                budget -= num_new
                i += 1

        self._step_blocked_by_kv = bool(out.preempted)
        self._step_seq_capped = False
        if not out.preempted:
            now = time.monotonic()
            budget = self._schedule_swapped(out, budget, chunk_cap)
            # NOTE: newcomers wait until every swapped request is back, so none starves.
            if not self.swapped:
                admit = self._admit_static if self._is_static else self._admit_waiting
                budget = admit(out, budget, chunk_cap, now)

        out.total_num_scheduled_tokens = config.max_num_batched_tokens - budget
        return out

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, chunk_cap: int) -> int:
        kv = self.kv
        while self.swapped and budget > 0 and self._num_seqs < self.config.max_num_seqs:
            request = self.swapped[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget, chunk_cap)
            num_blocks = cdiv(request.num_computed_tokens + num_new, self.block_size)
            if num_blocks + self._growth_reserve() > kv.num_free_blocks:
                break
            copies = kv.swap_in(request.request_id)
            assert copies is not None
            out.swap_in.extend(copies)
            self.swapped.pop(0)
            self._num_entries += 1
            if request.events is not None:
                request.record("swapped_in", {"baton.preemption.blocks": len(copies)})
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_sort_key)
            budget = self._schedule_admitted(out, request, num_new, budget)
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, chunk_cap: int, now: float) -> int:
        waiting = self._waiting
        promised = self._num_promised_blocks()
        while waiting and budget > 0 and self._num_seqs < self.config.max_num_seqs:
            request = waiting[0][2]
            if not self._can_admit(request, promised):
                self._step_blocked_by_kv = True
                break  # head-of-line: lower-priority requests do not jump ahead
            heapq.heappop(waiting)
            budget = self._admit(out, request, budget, chunk_cap, now)
            promised += self._blocks_still_to_take(request)
        if waiting and self._num_seqs >= self.config.max_num_seqs:
            self._step_seq_capped = True
        return budget

    def _admit_static(self, out: SchedulerOutput, budget: int, chunk_cap: int, now: float) -> int:
        """Static batching: a new batch forms only when the last one is done.

        Members preempted from outside (the static loop itself never needs to)
        come back first. Every member reserves its worst-case blocks on
        admission; the batch may exceed the token budget (its prompts are then
        prefilled over the next steps).
        """
        requeue = self._static_requeue
        while requeue and self._num_seqs < self.config.max_num_seqs:
            if not self._can_reserve(requeue[0]):
                self._step_blocked_by_kv = True
                return budget
            request = requeue.pop(0)
            budget = self._admit(out, request, budget, chunk_cap, now, reserve=True)
        if self._static_batch:
            return budget
        waiting = self._waiting
        while waiting and self._num_seqs < self.config.max_num_seqs:
            request = waiting[0][2]
            if not self._can_reserve(request):
                self._step_blocked_by_kv = True
                break
            heapq.heappop(waiting)
            self._static_batch.add(request.request_id)
            budget = self._admit(out, request, budget, chunk_cap, now, reserve=True)
        return budget

    def _can_reserve(self, request: Request) -> bool:
        """Whether the request's worst-case blocks fit in the free blocks."""
        peak = self.peak_kv_tokens(request.num_prompt_tokens, request.sampling_params.max_tokens)
        return cdiv(peak, self.block_size) <= self.kv.num_free_blocks - self._num_promised_blocks()

    def _growth_reserve(self) -> int:
        """Blocks kept free so the running batch can grow for a few decode steps."""
        return cdiv(len(self.running) * self.config.admission_reserve_steps, self.block_size)

    def _num_promised_blocks(self) -> int:
        """Blocks that running requests still prefilling will take for the rest of their prompt.

        Admission allocates only a request's first chunk, so these are not yet
        off the free list but are no longer free to promise to a newcomer.
        """
        return sum(
            self._blocks_still_to_take(request)
            for request in self.running
            if request.num_computed_tokens < len(request.all_token_ids) - 1
        )

    def _blocks_still_to_take(self, request: Request) -> int:
        """Blocks the request's table lacks to cover all of its current tokens."""
        return self.kv.num_new_blocks(request.request_id, len(request.all_token_ids))

    def _can_admit(self, request: Request, promised: int) -> bool:
        """Whether the request's whole prompt (and growth room) fits in the unpromised free blocks."""
        num_blocks = cdiv(request.num_tokens, self.block_size)
        available = self.kv.num_free_blocks - promised
        if not self.running and not self.swapped:
            return num_blocks <= available
        reserve = cdiv(
            (len(self.running) + 1) * self.config.admission_reserve_steps, self.block_size
        )
        return num_blocks + reserve <= available

    def _admit(
        self,
        out: SchedulerOutput,
        request: Request,
        budget: int,
        chunk_cap: int,
        now: float,
        reserve: bool = False,
    ) -> int:
        """Move a waiting request to running; with `reserve`, take its worst-case blocks now."""
        assert request.num_computed_tokens == 0
        request.status = RequestStatus.RECEIVING if request.kv_remote else RequestStatus.RUNNING
        effective_priority = (
            request.priority
            - (self.step_index - request.arrival_step) // self.config.priority_aging_steps
        )
        request.sort_key = (effective_priority, self._num_admissions)
        self._num_admissions += 1
        self._num_entries += 1
        first = request.first_scheduled_time is None
        if first:
            request.first_scheduled_time = now
            self.queue_times.append(now - request.arrival_time)
            self._queue_time_total += now - request.arrival_time
        if not request.kv_remote and request.prefill_start_time is None:
            request.prefill_start_time = now
        if request.events is not None:
            request.record("admitted", {
                "baton.queue_time_s": now - request.arrival_time,
                "baton.readmitted": not first,
                "baton.kv_remote": request.kv_remote,
            })
        if request.kv_remote:
            num_tokens = request.num_prompt_tokens
            if reserve:
                num_tokens = self.peak_kv_tokens(num_tokens, request.sampling_params.max_tokens)
            ok = self.kv.allocate_slots(request.request_id, num_tokens)
            assert ok, "admission checked the free blocks"
            self.receiving[request.request_id] = request
            out.kv_receives.append(request)
            return budget
        bisect.insort(self.running, request, key=_sort_key)
        if reserve:
            peak = self.peak_kv_tokens(request.num_prompt_tokens, request.sampling_params.max_tokens)
            ok = self.kv.allocate_slots(request.request_id, peak)
            assert ok, "admission checked the free blocks"
        num_new = min(request.num_tokens, budget, chunk_cap)
        if num_new == 0:  # static batching admits past the token budget
            ok = self.kv.allocate_slots(request.request_id, 0)
            assert ok
            return budget
        return self._schedule_admitted(out, request, num_new, budget)

    def _schedule_admitted(
        self, out: SchedulerOutput, request: Request, num_new: int, budget: int
    ) -> int:
        ok = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new)
        assert ok, "admission checked the free blocks"
        out.requests.append(request)
        out.num_scheduled_tokens.append(num_new)
        return budget - num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        mode = self.config.preemption_mode
        kv = self.kv
        request_id = request.request_id
        kind = PreemptionKind.RECOMPUTE
        if mode != "recompute" and kv.can_swap_out(request_id):
            if mode == "swap":
                kind = PreemptionKind.SWAP
            else:
                kind = self.cost_model.choose(
                    request.num_computed_tokens, len(kv.get_block_ids(request_id))
                )
        if request.events is not None:
            request.record("preempted", {
                "baton.preemption.kind": kind.value,
                "baton.preemption.blocks": len(kv.get_block_ids(request_id)),
                "baton.computed_tokens": request.num_computed_tokens,
            })
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions[kind] += 1
        out.preempted.append((request, kind))
        if kind is PreemptionKind.SWAP:
            copies = kv.swap_out(request_id)
            out.swap_out.extend(copies)
            self.num_swapped_blocks_out += len(copies)
            request.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, request, key=_sort_key)
        else:
            kv.free(request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            if self._is_static:
                bisect.insort(self._static_requeue, request, key=_sort_key)
            else:
                self._push_waiting(request)

    # ---------------------------------------------------------------- update
    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled_requests: list[Request],
        sampled_token_ids: list[int],
    ) -> list[Request]:
        """Advance progress by the step's work, append sampled tokens, finish what stopped.

        Returns the requests that finished in this step.
        """
        for request, num_new in zip(out.requests, out.num_scheduled_tokens):
            request.num_computed_tokens += num_new
        finished: list[Request] = []
        max_model_len = self.max_model_len
        for request, token_id in zip(sampled_requests, sampled_token_ids):
            token_ids = request.all_token_ids
            token_ids.append(token_id)
            params = request.sampling_params
            num_output = len(token_ids) - len(request.prompt_token_ids)
            status = None
            if num_output >= params.min_tokens and (
                token_id in request.eos_token_ids or token_id in params.stop_token_ids
            ):
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
            elif num_output >= params.max_tokens or len(token_ids) >= max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.finish_request(request, status)
                finished.append(request)
            elif request.prefill_only:
                self._hold(request)
        self._record_step(out)
        return finished

    def _hold(self, request: Request) -> None:
        """Take a prefilled request out of the batch, keeping its blocks for a handoff."""
        self.running.remove(request)
        request.status = RequestStatus.HELD
        self.held[request.request_id] = request

    def _record_step(self, out: SchedulerOutput) -> None:
        self.step_index += 1
        self.num_tokens_last_step = out.total_num_scheduled_tokens
        self.num_tokens_total += out.total_num_scheduled_tokens
        self._num_seqs_total += len(out.requests)
        used = self.kv.num_used_blocks
        if used:
            held = sum(request.num_computed_tokens for request in self.running)
            self._kv_efficiency_total += held / (used * self.block_size)
        else:
            self._kv_efficiency_total += 1.0
        self._kv_used_total += used
        num_waiting = self.num_waiting
        self._waiting_total += num_waiting
        if num_waiting:
            if self._step_blocked_by_kv or self.swapped:
                self._num_steps_kv_blocked += 1
            elif self._step_seq_capped:
                self._num_steps_seq_capped += 1
        now = time.monotonic()
        recent = self._recent
        recent.append((now, self._totals()))
        while len(recent) > 2 and recent[1][0] < now - RECENT_WINDOW_S:
            recent.popleft()

    def _totals(self) -> tuple:
        """The cumulative counters named in _TOTALS, in that order."""
        return (
            self.step_index, self._num_seqs_total, self.num_tokens_total, self._kv_used_total,
            self._waiting_total, self._num_entries, self.num_preemptions[PreemptionKind.RECOMPUTE],
            self.num_preemptions[PreemptionKind.SWAP], self.num_swapped_blocks_out, len(self.queue_times),
            self._queue_time_total, self._num_steps_kv_blocked, self._num_steps_seq_capped,
        )

    def recent_stats(self, now: float | None = None) -> RecentStats:
        """Counts and means over the steps of the last RECENT_WINDOW_S seconds."""
        now = time.monotonic() if now is None else now
        recent = self._recent
        while len(recent) > 1 and recent[1][0] < now - RECENT_WINDOW_S:
            recent.popleft()
        (first_time, first), (last_time, last) = recent[0], recent[-1]
        if len(recent) == 1 or last_time < now - RECENT_WINDOW_S:
            first = last  # idle for the whole window
        delta = dict(zip(_TOTALS, (b - a for a, b in zip(first, last))))
        steps = delta["steps"]
        per_step = 1 / steps if steps else 0.0
        total_blocks = self.kv.pool.num_blocks
        return RecentStats(
            window_s=RECENT_WINDOW_S,
            seconds=last_time - max(first_time, now - RECENT_WINDOW_S) if steps else 0.0,
            seconds_since_last_step=now - last_time if self.step_index else float("inf"),
            num_steps=steps,
            mean_batch_size=delta["seqs"] * per_step,
            mean_tokens_per_step=delta["tokens"] * per_step,
            mean_kv_usage=delta["kv_used"] * per_step / total_blocks if total_blocks else 0.0,
            mean_num_waiting=delta["waiting"] * per_step,
            num_admissions=delta["admissions"],
            num_preemptions_recompute=delta["preempt_recompute"],
            num_preemptions_swap=delta["preempt_swap"],
            num_swapped_blocks_out=delta["swap_blocks"],
            num_queued=delta["queued"],
            mean_queue_time=delta["queue_time"] / delta["queued"] if delta["queued"] else 0.0,
            num_steps_kv_blocked=delta["kv_blocked"],
            num_steps_seq_capped=delta["seq_capped"],
        )

    def stats(self, with_queue_times: bool = True) -> SchedulerStats:
        steps = max(self.step_index, 1)
        kv = self.kv
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            num_swapped=len(self.swapped),
            num_held=len(self.held),
            num_receiving=len(self.receiving),
            num_queued_prefill_tokens=self._num_queued_prefill_tokens(),
            num_kv_blocks_total=kv.pool.num_blocks,
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_free=kv.num_free_blocks,
            num_swap_blocks_total=kv.swap_pool.num_blocks,
            num_swap_blocks_used=kv.swap_pool.num_used,
            num_preemptions_recompute=self.num_preemptions[PreemptionKind.RECOMPUTE],
            num_preemptions_swap=self.num_preemptions[PreemptionKind.SWAP],
            num_swapped_blocks_out=self.num_swapped_blocks_out,
            num_steps=self.step_index,
            num_tokens_last_step=self.num_tokens_last_step,
            num_tokens_scheduled_total=self.num_tokens_total,
            mean_tokens_per_step=self.num_tokens_total / steps,
            mean_seqs_per_step=self._num_seqs_total / steps,
            kv_memory_efficiency=self._kv_efficiency_total / steps,
            num_finished=self._num_finished,
            mean_queue_time=self._queue_time_total / max(len(self.queue_times), 1),
            queue_times=tuple(self.queue_times) if with_queue_times else (),
            recent=self.recent_stats(),
            oldest_queued_time=self._oldest_queued_time(),
        )

    def _oldest_queued_time(self) -> float:
        arrivals = [request.arrival_time for _, _, request in self._waiting if request.first_scheduled_time is None]
        return time.monotonic() - min(arrivals) if arrivals else 0.0

    def _num_queued_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens not yet computed: waiting requests and running chunks."""
        queued = sum(
            request.num_tokens for _, _, request in self._waiting if not request.kv_remote
        )
        queued += sum(request.num_tokens for request in self._static_requeue)
        for request in self.running:
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1:
                queued += remaining
        return queued

    # ------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Each live request is in exactly one queue, and holds exactly the blocks its state allows."""
        self.kv.check_integrity()
        waiting = [entry[2] for entry in self._waiting] + self._static_requeue
        queues = {
            RequestStatus.WAITING: waiting,
            RequestStatus.RUNNING: self.running,
            RequestStatus.SWAPPED: self.swapped,
            RequestStatus.HELD: list(self.held.values()),
            RequestStatus.RECEIVING: list(self.receiving.values()),
        }
        seen: set[str] = set()
        for status, queue in queues.items():
            for request in queue:
                if request.status != status:
                    raise AssertionError(f"{request} is in the {status.name} queue")
                if request.request_id in seen:
                    raise AssertionError(f"{request} is queued twice")
                seen.add(request.request_id)
        if seen != set(self.requests):
            raise AssertionError("queues and the request table disagree")
        holders = self.kv.holders()
        for request in self.running:
            if not self.kv.has_blocks(request.request_id):
                raise AssertionError(f"running {request} holds no block table")
            covered = len(self.kv.get_block_ids(request.request_id)) * self.block_size
            if covered < request.num_computed_tokens:
                raise AssertionError(f"{request} has computed tokens outside its blocks")
        for request in waiting:
            if request.request_id in holders or request.num_computed_tokens != 0:
                raise AssertionError(f"waiting {request} holds KV")
        running_ids = {request.request_id for request in self.running}
        swapped_ids = {request.request_id for request in self.swapped}
        handoff_ids = set(self.held) | set(self.receiving)
        if holders != running_ids | swapped_ids | handoff_ids:
            raise AssertionError(
                "block holders are not exactly the running, swapped, held and receiving requests"
            )
        if self.running != sorted(self.running, key=_sort_key):
            raise AssertionError("running queue out of priority order")
        if self._num_seqs > self.config.max_num_seqs:
            raise AssertionError("more running sequences than max_num_seqs")


def _sort_key(request: Request) -> tuple[int, int]:
    return request.sort_key
