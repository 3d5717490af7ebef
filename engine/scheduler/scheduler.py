"""Token-budget, iteration-level scheduler with chunked prefill and preemption.

One loop, no prefill/decode phases: each step every request's
`num_computed_tokens` catches up with its `num_tokens` as far as the step's
token budget allows. Order of service within a step:

    1. RUNNING requests, highest priority first (then earliest deadline): one
       token when decoding, a chunk when prefilling. A request whose table cannot
       grow preempts the lowest-priority running request (possibly itself): of
       those, one without a deadline, else the latest deadline, and the most
       recently admitted; by recompute or swap, whichever the cost model finds cheaper.
    2. SWAPPED requests come back if nothing was preempted this step.
    3. WAITING requests are admitted by the admission policy, if nothing was
       preempted this step and no request is still swapped out: continuous
       (continuous.py) or static batch-at-a-time (static.py).

Disaggregated serving adds two states that hold blocks but are not scheduled,
HELD and RECEIVING (handoff.py).

Prefix caching: admission starts a request's table with the cached blocks of its
prefix and counts them as computed (prefix.py).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from engine.config import PreemptionKind, SchedulerConfig
from engine.kv.landing import Landing, LandingZone
from engine.kv.manager import KVCacheManager, PrefixHit, cdiv
from engine.request import (PENDING_TOKEN, InvalidRequestError, PromptTooLongError, Request, RequestStatus,
                            by_sort_key, deadline_key)
from engine.scheduler.budget import UNLIMITED, prefill_limit
from engine.scheduler.continuous import ContinuousAdmission
from engine.scheduler.handoff import KvHandoffs
from engine.scheduler.integrity import check_scheduler_integrity
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.policy import AdmissionPolicy
from engine.scheduler.preemption import PreemptionCostModel
from engine.scheduler.prefix import PrefixMatcher
from engine.scheduler.speculative import schedule_proposals, settle_proposals
from engine.scheduler.static import StaticAdmission
from engine.scheduler.stats import SchedulerCounters, SchedulerStats, snapshot_stats
from engine.scheduler.stopping import ends_by_length, stop_status
from engine.statistics import RecentStats
from engine.timeline import Admitted, Preempted, SwappedIn

ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    "continuous": ContinuousAdmission,
    "static": StaticAdmission,
}


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
        self.running: list[Request] = []  # sorted by Request.sort_key
        self.swapped: list[Request] = []  # sorted by Request.sort_key
        self.prefix = PrefixMatcher(kv)
        self.handoffs = KvHandoffs(kv, self.prefix)  # HELD and RECEIVING requests
        self.landing = LandingZone(kv)  # blocks set aside for handoffs (a decode worker opens it)
        # The WAITING requests are the policy's.
        self.policy: AdmissionPolicy = ADMISSION_POLICIES[config.policy](config)
        self._num_arrivals = 0
        self._num_admissions = 0
        self.counters = SchedulerCounters(kv.prefix_stats)
        # This step left requests waiting for KV blocks / at the max_num_seqs cap.
        self._step_blocked_by_kv = False
        self._step_seq_capped = False
        # Once a handed-off request arrived, decoding rows limit a step's prompt tokens
        # (budget.py) by the decode line the engine sets here: seconds of n rows' step.
        self.serves_handoffs = False
        self.decode_step_s: Callable[[int, int], float] | None = None
        self._held_prompts = False  # the last step took no prompt tokens, for a handoff's first decode step

    # ------------------------------------------------------------- requests
    @property
    def step_index(self) -> int:
        """Steps run so far (waiting requests age by it)."""
        return self.counters.num_steps

    @property
    def num_waiting(self) -> int:
        return self.policy.num_waiting

    @property
    def num_seqs(self) -> int:
        """Sequences counted against max_num_seqs: running, and receiving or landing (about to run)."""
        return len(self.running) + len(self.handoffs.receiving) + self.landing.num_claimed

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or host-tier copies a step has still to run."""
        return bool(self.requests) or self.kv.has_tier_copies

    def has_schedulable_requests(self) -> bool:
        """Whether a step could do any work (HELD and RECEIVING requests wait on others)."""
        return bool(self.running or self.swapped or self.policy.num_waiting) or self.kv.has_tier_copies

    def peak_kv_tokens(self, request: Request) -> int:
        """The most tokens a request ever holds in the KV cache (the last sampled token ends
        the request before its KV is computed)."""
        return request.max_num_tokens(self.max_model_len) - 1

    def check_admissible(self, request: Request) -> None:
        """Raise InvalidRequestError for a request that could never run here: PromptTooLongError
        for a prompt that reaches max_model_len; one whose peak KV outgrows the whole cache
        names its prompt if that alone does, else its max_tokens (a lower one would fit)."""
        num_prompt_tokens = request.num_prompt_tokens
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {num_prompt_tokens} tokens; max_model_len is {self.max_model_len}")
        peak_tokens = self.peak_kv_tokens(request)
        num_blocks = self.kv.pool.num_blocks
        if cdiv(peak_tokens, self.block_size) > num_blocks:
            # The least a request holds is its prompt (max_tokens == 1).
            name = ("prompt_token_ids" if cdiv(num_prompt_tokens, self.block_size) > num_blocks
                    else "sampling_params.max_tokens")
            raise InvalidRequestError(
                name, f"request needs up to {cdiv(peak_tokens, self.block_size)} KV blocks; the cache has {num_blocks}"
            )

    def add_request(self, request: Request, landing: Landing | None = None) -> None:
        """Queue a request; one with a `landing` (blocks set aside for it as its call arrived,
        engine/kv/landing.py) is RECEIVING in them at once."""
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"duplicate request id {request.request_id!r}")
        self.check_admissible(request)
        if landing is not None:
            self.landing.land(landing, request.request_id)
        request.arrival_step = self.step_index
        request.arrival_index = self._num_arrivals
        self._num_arrivals += 1
        self.requests[request.request_id] = request
        self.serves_handoffs |= request.kv_remote
        if landing is None:
            # Its prefill work as it waits (stats): the prompt less what the cache holds now.
            request.num_cached_estimate = self.prefix.hit(request).num_tokens(self.block_size)
            self.policy.add(request)
            return
        request.arrival_time = landing.claimed_at  # it arrived, and was admitted, as it claimed them
        self._enter(request, landing.claimed_at)
        if request.events is not None:
            request.record(Admitted(queue_time_s=0.0, readmitted=False, kv_remote=True, cached_tokens=0))
        self.handoffs.land(request, landing)

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
            self.handoffs.forget(request)
        else:
            self.policy.remove(request)
        # Tokens of steps still in flight (sampled after the one that ended it) reach no one.
        token_ids = request.all_token_ids
        while token_ids[-1] == PENDING_TOKEN:
            token_ids.pop()
        request.status = status
        self.requests.pop(request.request_id, None)
        self.policy.on_finished(request)
        self.counters.num_finished += 1

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

    def release_held(self, request_id: str) -> Request | None:
        """End a HELD request whose KV was handed off (or given up); frees its blocks."""
        request = self.handoffs.held.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_HANDED_OFF)
        return request

    def complete_kv_receive(self, request_id: str, ok: bool, fence_id: str | None = None,
                            landing: str | None = None) -> Request | None:
        """A RECEIVING request's KV arrived (`ok`) or will not (then it prefills here). With
        `fence_id`, the failed receive's blocks go under that fence (KVCacheManager.fence).
        `landing`: the ticket it received into; None: admitted from the queue (a receive
        for another request of the same id changes nothing)."""
        request = self.handoffs.receiving.get(request_id)
        if request is None or request.landing != landing:
            return None
        if fence_id is not None:
            assert not ok, "a completed receive has nothing to fence"
            # The reused prefix was never written: only the blocks being received are in doubt.
            self.kv.fence(request_id, fence_id, start=request.num_reused_blocks)
        if request.abort_requested:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
            return None
        self.handoffs.end_receive(request, ok)
        if ok:
            bisect.insort(self.running, request, key=by_sort_key)
        else:
            self.policy.add(request)
        return request

    # ------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        self.landing.drain()  # the step sees every free block
        out = SchedulerOutput()
        config = self.config
        budget = config.max_num_batched_tokens
        chunk_cap = config.long_prefill_token_threshold or budget
        prefill_left = self.prefill_limit()
        self._held_prompts = prefill_left == 0  # (a limit is otherwise at least a block's worth)
        budget, prefill_left = self._schedule_running(out, budget, chunk_cap, prefill_left)

        self._step_blocked_by_kv = bool(out.preempted)
        self._step_seq_capped = False
        if not out.preempted:
            now = time.monotonic()
            budget, prefill_left = self._schedule_swapped(out, budget, chunk_cap, prefill_left)
            # NOTE: newcomers wait until every swapped request is back, so none starves.
            if not self.swapped:
                admissions = min(budget, prefill_left)
                budget -= admissions - self._admit_chosen(out, admissions, chunk_cap, now)
                self._step_blocked_by_kv = self.policy.is_kv_short
                self._step_seq_capped = self.policy.is_seq_capped

        out.total_num_scheduled_tokens = config.max_num_batched_tokens - budget
        if not self.swapped and not out.preempted:  # (engine/kv/landing.py)
            self.landing.refill(self.policy.landing_room(self), config.max_num_seqs - self.num_seqs)
        out.offload, out.reload, out.tier_holds = self.kv.take_tier_copies()  # (engine/kv/host_tier.py)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, chunk_cap: int,
                          prefill_left: int) -> tuple[int, int]:
        """1. Running requests, highest priority first; returns the token budget and the
        prompt tokens (prefill_limit) left."""
        kv = self.kv
        running = self.running
        requests = out.requests
        num_scheduled = out.num_scheduled_tokens
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            remaining = len(request.all_token_ids) - request.num_computed_tokens
            num_new = min(remaining, budget, chunk_cap)
            if remaining > 1:  # a prompt's chunk (a decoding row has one token to compute)
                num_new = min(num_new, prefill_left)
            if num_new <= 0:
                i += 1
                continue
            if remaining == 1 and request.spec_token_ids:
                # Its proposals, as far as the budget leaves each row after it its token.
                num_new += schedule_proposals(kv, out, request, budget - (len(running) - i), self.max_model_len)
            while not kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                victim = running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                requests.append(request)
                num_scheduled.append(num_new)
                budget -= num_new
                prefill_left -= num_new if remaining > 1 else 0
                i += 1
        return budget, prefill_left

    def prefill_limit(self) -> int:
        """Prompt tokens this step may take besides its token budget (budget.py)."""
        if not self.serves_handoffs or self.decode_step_s is None:
            return UNLIMITED
        return prefill_limit(self.config.max_decode_stretch, self.running, self.policy.num_waiting,
                             self.decode_step_s, self.cost_model.measured_prefill_seconds_per_token,
                             self.block_size, may_hold=not self._held_prompts)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, chunk_cap: int,
                          prefill_left: int) -> tuple[int, int]:
        """Swap requests back in, in order, while blocks allow; returns the token budget and
        the prompt tokens (prefill_limit) left."""
        kv = self.kv
        while self.swapped and budget > 0 and self.num_seqs < self.config.max_num_seqs:
            request = self.swapped[0]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget, chunk_cap, prefill_left if remaining > 1 else 1)
            if num_new <= 0:  # mid-prompt, and this step's prompt tokens are spent
                break
            # Its swapped table may be longer (a static batch's worst case, taken at admission).
            num_blocks = max(cdiv(request.num_computed_tokens + num_new, self.block_size),
                             kv.num_swapped_blocks(request.request_id))
            if num_blocks + self._growth_reserve() > kv.num_free_blocks:
                break
            copies = kv.swap_in(request.request_id)
            assert copies is not None
            out.swap_in.extend(copies)
            self.swapped.pop(0)
            self.counters.record_entry()
            if request.events is not None:
                request.record(SwappedIn(num_blocks=len(copies)))
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=by_sort_key)
            budget = self._schedule_admitted(out, request, num_new, budget)
            prefill_left -= num_new if remaining > 1 else 0
        return budget, prefill_left

    def _growth_reserve(self) -> int:
        """Blocks kept free so the running batch can grow for a few decode steps."""
        return cdiv(len(self.running) * self.config.admission_reserve_steps, self.block_size)

    def _admit_chosen(self, out: SchedulerOutput, budget: int, chunk_cap: int, now: float) -> int:
        """Admit the waiting requests the policy chooses, one by one (it sees each admission
        before choosing the next); returns the budget left."""
        choices = self.policy.choose(self, budget)
        try:
            choice = next(choices)
            while True:
                budget = self.start_running(out, choice.request, budget, chunk_cap, now, choice.reserve, choice.hit)
                choice = choices.send(budget)
        except StopIteration:
            return budget

    def start_running(
        self,
        out: SchedulerOutput,
        request: Request,
        budget: int,
        chunk_cap: int,
        now: float,
        reserve: bool = False,
        hit: PrefixHit | None = None,
    ) -> int:
        """Move a request the policy took off its queue into the batch, scheduling its
        first chunk; with `reserve`, take its worst-case blocks now. `hit`: its prefix
        lookup, if the policy made it to decide (else made here). Returns the budget left."""
        assert request.num_computed_tokens == 0
        request.status = RequestStatus.RECEIVING if request.kv_remote else RequestStatus.RUNNING
        first = self._enter(request, now)
        if hit is None:
            hit = self.prefix.hit(request)
        num_cached = request.num_cached_estimate = hit.num_tokens(self.block_size)
        if request.events is not None:
            request.record(Admitted(queue_time_s=now - request.arrival_time, readmitted=not first,
                                    kv_remote=request.kv_remote, cached_tokens=num_cached,
                                    host_cached_tokens=len(hit.host_block_ids) * self.block_size))
        # Its table: the cached prefix, then its prompt's blocks (received: all of them now) or,
        # reserving, its worst case.
        num_tokens = request.num_prompt_tokens if request.kv_remote else num_cached
        if reserve:
            num_tokens = self.peak_kv_tokens(request)
        ok = self.kv.allocate_admission(
            request.request_id, hit, num_tokens, received=request.kv_remote,
            num_queried_tokens=request.num_prompt_tokens if request.kv_remote else request.num_tokens)
        assert ok, "admission checked the free blocks"
        if request.kv_remote:
            request.num_reused_blocks = hit.num_blocks
            self.handoffs.receive(request)
            out.kv_receives.append(request)
            return budget
        bisect.insort(self.running, request, key=by_sort_key)
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens is None and request.kv_ready_time is None:  # a received prompt's are the sender's
            request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            # The host tier's blocks come after the device's in the hit.
            request.num_host_cached_tokens = max(request.num_cached_tokens - len(hit.block_ids) * self.block_size, 0)
        num_new = min(request.num_tokens - num_cached, budget, chunk_cap)
        if num_new == 0:  # static batching admits past the token budget
            return budget
        return self._schedule_admitted(out, request, num_new, budget)

    def _enter(self, request: Request, now: float) -> bool:
        """Stamp a request joining the batch: its place in it (sort key), its first-admission
        and prefill-start times, the entry count; whether this is its first admission."""
        effective_priority = request.priority - (self.step_index - request.arrival_step) // self.config.priority_aging_steps
        # NOTE: within a priority the request without a deadline, then the latest, is
        # preempted first (running[-1]): it has the most time to make up for it.
        request.sort_key = (effective_priority, deadline_key(request.deadline), self._num_admissions)
        self._num_admissions += 1
        first = request.first_scheduled_time is None
        if first:
            request.first_scheduled_time = now
        self.counters.record_entry(now - request.arrival_time if first else None)
        if not request.kv_remote and request.prefill_start_time is None:
            request.prefill_start_time = now
        return first

    def _schedule_admitted(self, out: SchedulerOutput, request: Request, num_new: int, budget: int) -> int:
        ok = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new)
        assert ok, "admission checked the free blocks"
        out.requests.append(request)
        out.num_scheduled_tokens.append(num_new)
        return budget - num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Take `request` out of the running batch to free its blocks: swapped out to CPU, or
        dropped to recompute later (back in the queue), as the preemption mode and the cost
        model choose."""
        kind = self._preemption_kind(request)
        kv, request_id = self.kv, request.request_id
        if request.events is not None:
            request.record(Preempted(kind=kind, num_blocks=len(kv.get_block_ids(request_id)),
                                     num_computed_tokens=request.num_computed_tokens))
        self.running.remove(request)
        request.spec_token_ids = []
        request.num_preemptions += 1
        out.preempted.append((request, kind))
        if kind is PreemptionKind.SWAP:
            copies = kv.swap_out(request_id)
            out.swap_out.extend(copies)
            self.counters.record_preemption(kind, len(copies))
            request.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, request, key=by_sort_key)
        else:
            self.counters.record_preemption(kind)
            kv.free(request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.policy.requeue(request)

    def _preemption_kind(self, request: Request) -> PreemptionKind:
        """Swap or recompute, as the preemption mode says, or (auto) the cost model finds cheaper."""
        mode, kv, request_id = self.config.preemption_mode, self.kv, request.request_id
        if mode == "recompute" or not kv.can_swap_out(request_id):
            return PreemptionKind.RECOMPUTE
        if mode == "swap":
            return PreemptionKind.SWAP
        # What the readmission's lookup would find (prefix.py: none when prompt logprobs are due).
        kept = (0, 0) if request.prompt_logprobs is not None else kv.num_kept_blocks(
            request_id, (request.num_tokens - 1) // kv.block_size)
        return self.cost_model.choose(request.num_computed_tokens, len(kv.get_block_ids(request_id)), kept,
                                      kv.block_size)

    # ---------------------------------------------------------------- update
    def complete_step(self, out: SchedulerOutput, sampled_requests: list[Request],
                      sampled_token_ids: list[int]) -> list[Request]:
        """Advance progress by the step's work, append sampled tokens, finish what stopped
        (`advance` then `resolve`, for a step whose tokens are already known: it has ended,
        and what its host-tier copies held is let go).

        Returns the requests that finished in this step.
        """
        positions = self.advance(out, sampled_requests)
        finished = self.resolve(sampled_requests, [[token_id] for token_id in sampled_token_ids], positions)
        self.end_step(out)
        self.kv.release_tier_holds(out.tier_holds)
        return finished

    def advance(self, out: SchedulerOutput, sampled_requests: list[Request]) -> list[int | None]:
        """Account for a step as launched, before its sampled tokens are known.

        Progress moves by the scheduled tokens. A sampled request that may run again
        before `resolve` gets a PENDING_TOKEN, so that the next `schedule` gives it its
        decode step (the runner feeds it the token from the device); one whose token
        ends it for certain (max_tokens, max_model_len) or that stops after its first
        token (prefill_only, HELD from now on) gets none and is not scheduled again.
        Returns, per sampled request, where `resolve` writes its token in
        `all_token_ids` (None: appended).
        """
        caching = self.kv.enable_prefix_caching  # (cache_computed checks it too: here no call at all when off)
        cache_computed = self.prefix.cache_computed
        proposals = out.spec_token_ids
        for request, num_new in zip(out.requests, out.num_scheduled_tokens):
            # A row's proposals count as computed once accepted (resolve).
            request.num_computed_tokens += num_new - len(proposals[request.request_id]) if proposals and \
                request.request_id in proposals else num_new
            if caching:
                cache_computed(request)
        positions: list[int | None] = []
        for index, request in enumerate(sampled_requests):
            token_ids = request.all_token_ids
            if request.prefill_only:
                self.running.remove(request)
                self.handoffs.hold(request)
                positions.append(None)
            elif ends_by_length(request, len(token_ids) + 1, self.max_model_len):
                positions.append(None)
            else:
                positions.append(len(token_ids))
                token_ids.append(PENDING_TOKEN)
                request.pending_sample_index = index
        return positions

    def resolve(self, sampled_requests: list[Request], emitted: list[list[int]], positions: list[int | None],
                proposals: dict[str, list[int]] | None = None) -> list[Request]:
        """Put a launched step's tokens in place (`advance` said where the first goes) and
        finish what they stop. `emitted`: each request's tokens, one or, for a row that
        checked `proposals`, its accepted proposals and the model's next token; a list is
        cut after a token that ends its request (what follows reaches no one). A request
        that ended meanwhile (aborted, or stopped by the token of the step before) is
        skipped: its token reaches no one. Returns the requests that finished.
        """
        finished: list[Request] = []
        for request, tokens, position in zip(sampled_requests, emitted, positions):
            if request.is_finished:
                continue
            token_ids = request.all_token_ids
            for index, token_id in enumerate(tokens):
                if index == 0 and position is not None:
                    token_ids[position] = token_id
                    num_tokens = position + 1
                else:
                    token_ids.append(token_id)
                    num_tokens = len(token_ids)
                status = stop_status(request, token_id, num_tokens, self.max_model_len)
                if status is not None:
                    del tokens[index + 1:]
                    self.finish_request(request, status)
                    finished.append(request)
                    break
            else:
                if proposals and request.request_id in proposals:
                    settle_proposals(self.prefix, self.kv, request, len(tokens) - 1)
        return finished

    def end_step(self, out: SchedulerOutput) -> None:
        """Count a step (scheduled as `out`) in the stats, once its launch is accounted for."""
        used = self.kv.num_used_blocks
        if used:
            held = sum(request.num_computed_tokens for request in self.running)
            kv_efficiency = min(1.0, held / (used * self.block_size))  # shared blocks count once
        else:
            kv_efficiency = 1.0
        self.counters.end_step(len(out.requests), out.total_num_scheduled_tokens, used, kv_efficiency,
                               self.policy.num_waiting, self._step_blocked_by_kv or bool(self.swapped),
                               self._step_seq_capped)

    # ---------------------------------------------------------------- stats
    def recent_stats(self, now: float | None = None) -> RecentStats:
        """Counts and means over the steps of the last RECENT_WINDOW_S seconds."""
        now = time.monotonic() if now is None else now
        return self.counters.recent(now, self.kv.pool.num_blocks)

    def stats(self, with_queue_times: bool = True) -> SchedulerStats:
        """Queues, KV blocks and counters now; `with_queue_times` adds the latest queue times."""
        return snapshot_stats(self, with_queue_times)

    # ------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Each live request is in exactly one queue, and holds exactly the blocks its state allows."""
        check_scheduler_integrity(self)
