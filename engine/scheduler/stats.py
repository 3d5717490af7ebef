"""What the scheduler has done: cumulative counters, and the same over the last minute.

`SchedulerCounters` is bumped by the scheduler as it works. After every step it
also snapshots all of its cumulative counts into a ring spanning the last
RECENT_WINDOW_S seconds, so the recent statistics are the difference between
the ring's two ends, whatever the step rate. `SchedulerStats` and `RecentStats`
are the frozen snapshots handed out (`Scheduler.stats`, `snapshot_stats`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.config import PreemptionKind, SchedulerConfig
from engine.scheduler.preemption import PreemptionCostModel
from engine.statistics import EngineStats, RecentStats

if TYPE_CHECKING:
    from engine.kv.manager import KVCacheManager, PrefixCacheStats
    from engine.request import Request
    from engine.scheduler.handoff import KvHandoffs


class WaitingRequests(Protocol):
    def waiting_requests(self) -> list[Request]: ...


class SchedulerState(Protocol):
    """What the statistics and the integrity checks read of the scheduler (the Scheduler
    is one), so that they depend on the queues and counts, not on its module."""

    config: SchedulerConfig
    kv: KVCacheManager
    policy: WaitingRequests
    requests: dict[str, Request]
    running: list[Request]
    swapped: list[Request]
    handoffs: KvHandoffs
    counters: SchedulerCounters
    cost_model: PreemptionCostModel
    block_size: int

    @property
    def num_seqs(self) -> int: ...

    def recent_stats(self) -> RecentStats: ...


RECENT_WINDOW_S = 60.0
MAX_QUEUE_TIMES = 10_000  # the queue times SchedulerStats.queue_times lists, the latest
# Bounds the ring at a very high step rate; the window then covers fewer seconds.
_MAX_RECENT_STEPS = 1 << 16
# The cumulative counts each snapshot holds, in this order (see SchedulerCounters._totals).
_TOTALS = ("steps", "seqs", "tokens", "kv_used", "waiting", "admissions", "preempt_recompute",
           "preempt_swap", "swap_blocks", "queued", "queue_time", "kv_blocked", "seq_capped",
           "prefix_queried", "prefix_hit", "busy")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerStats(EngineStats):
    """A snapshot of the scheduler (see Scheduler.stats): the statistics every worker
    exports (engine/statistics.py declares them) and the engine's own."""

    num_held: int  # KV held for a handoff (prefill side)
    num_receiving: int  # blocks allocated, KV arriving (decode side)
    num_swap_blocks_used: int
    num_swapped_blocks_out: int
    num_tokens_last_step: int
    mean_tokens_per_step: float
    kv_memory_efficiency: float
    mean_queue_time: float
    queue_times: tuple[float, ...]  # the latest MAX_QUEUE_TIMES requests' (with_queue_times)
    recent: RecentStats


class SchedulerCounters:
    """Cumulative counts of the scheduler's work, and their snapshots over the recent window."""

    __slots__ = (
        "num_steps", "num_tokens_last_step", "num_tokens_total", "num_seqs_total",
        "kv_efficiency_total", "num_kv_blocks_used_total", "num_waiting_total", "num_entries",
        "num_preemptions", "num_swapped_blocks_out", "queue_times", "num_queued", "queue_time_total",
        "num_steps_kv_blocked", "num_steps_seq_capped", "num_finished", "snapshots", "prefix", "busy_seconds_total",
    )

    def __init__(self, prefix: PrefixCacheStats) -> None:
        # The KV manager's prefix-cache counts, snapshotted with the scheduler's own.
        self.prefix = prefix
        self.num_steps = 0
        self.num_tokens_last_step = 0
        self.num_tokens_total = 0
        # Sums over steps, for per-step means.
        self.num_seqs_total = 0
        self.kv_efficiency_total = 0.0
        self.num_kv_blocks_used_total = 0
        self.num_waiting_total = 0
        self.num_entries = 0  # admissions, readmissions and swap-ins
        self.num_preemptions = {PreemptionKind.RECOMPUTE: 0, PreemptionKind.SWAP: 0}
        self.num_swapped_blocks_out = 0
        # Arrival to first admission: the last MAX_QUEUE_TIMES requests' (a worker's life
        # would otherwise keep one per request), and the count and sum of all.
        self.queue_times: deque[float] = deque(maxlen=MAX_QUEUE_TIMES)
        self.num_queued = 0
        self.queue_time_total = 0.0
        self.num_steps_kv_blocked = 0
        self.num_steps_seq_capped = 0
        self.num_finished = 0
        # The engine's time in its steps (LLMEngine.step adds each call's): the time steps
        # took, without the idle gaps between them.
        self.busy_seconds_total = 0.0
        # (time, totals) after each step of the recent window; the first is its baseline.
        self.snapshots: deque[tuple[float, tuple]] = deque(maxlen=_MAX_RECENT_STEPS)
        self.snapshots.append((time.monotonic(), self._totals()))

    def record_entry(self, queue_time: float | None = None) -> None:
        """A request entered the running batch; `queue_time` on its first admission only."""
        self.num_entries += 1
        if queue_time is not None:
            self.queue_times.append(queue_time)
            self.num_queued += 1
            self.queue_time_total += queue_time

    def record_preemption(self, kind: PreemptionKind, num_blocks_swapped_out: int = 0) -> None:
        self.num_preemptions[kind] += 1
        self.num_swapped_blocks_out += num_blocks_swapped_out

    def end_step(
        self,
        num_seqs: int,
        num_tokens: int,
        num_kv_blocks_used: int,
        kv_efficiency: float,
        num_waiting: int,
        is_kv_short: bool,
        is_seq_capped: bool,
    ) -> None:
        """Count a finished step and snapshot the totals.

        `kv_efficiency` is the share of the used blocks' slots that hold computed
        KV; `is_kv_short` / `is_seq_capped` say why requests were left waiting, if any.
        """
        self.num_steps += 1
        self.num_tokens_last_step = num_tokens
        self.num_tokens_total += num_tokens
        self.num_seqs_total += num_seqs
        self.kv_efficiency_total += kv_efficiency
        self.num_kv_blocks_used_total += num_kv_blocks_used
        self.num_waiting_total += num_waiting
        if num_waiting:
            if is_kv_short:
                self.num_steps_kv_blocked += 1
            elif is_seq_capped:
                self.num_steps_seq_capped += 1
        now = time.monotonic()
        snapshots = self.snapshots
        snapshots.append((now, self._totals()))
        # Keep one snapshot older than the window: the baseline of its first step.
        while len(snapshots) > 2 and snapshots[1][0] < now - RECENT_WINDOW_S:
            snapshots.popleft()

    def _totals(self) -> tuple:
        """The cumulative counts named in _TOTALS, in that order."""
        return (
            self.num_steps, self.num_seqs_total, self.num_tokens_total, self.num_kv_blocks_used_total,
            self.num_waiting_total, self.num_entries, self.num_preemptions[PreemptionKind.RECOMPUTE],
            self.num_preemptions[PreemptionKind.SWAP], self.num_swapped_blocks_out, self.num_queued,
            self.queue_time_total, self.num_steps_kv_blocked, self.num_steps_seq_capped,
            self.prefix.num_queried_tokens, self.prefix.num_hit_tokens, self.busy_seconds_total,
        )

    def recent(self, now: float, num_kv_blocks: int) -> RecentStats:
        """Counts and means over the steps of the RECENT_WINDOW_S seconds before `now`."""
        snapshots = self.snapshots
        while len(snapshots) > 1 and snapshots[1][0] < now - RECENT_WINDOW_S:
            snapshots.popleft()
        (first_time, first), (last_time, last) = snapshots[0], snapshots[-1]
        if len(snapshots) == 1 or last_time < now - RECENT_WINDOW_S:
            first = last  # idle for the whole window
        delta = dict(zip(_TOTALS, (b - a for a, b in zip(first, last))))
        steps = delta["steps"]
        per_step = 1 / steps if steps else 0.0
        return RecentStats(
            window_seconds=RECENT_WINDOW_S,
            seconds=last_time - max(first_time, now - RECENT_WINDOW_S) if steps else 0.0,
            seconds_since_last_step=now - last_time if self.num_steps else float("inf"),
            num_steps=steps,
            mean_batch_size=delta["seqs"] * per_step,
            mean_tokens_per_step=delta["tokens"] * per_step,
            mean_kv_usage=delta["kv_used"] * per_step / num_kv_blocks if num_kv_blocks else 0.0,
            mean_num_waiting=delta["waiting"] * per_step,
            num_admissions=delta["admissions"],
            num_preemptions_recompute=delta["preempt_recompute"],
            num_preemptions_swap=delta["preempt_swap"],
            num_swapped_blocks_out=delta["swap_blocks"],
            num_queued=delta["queued"],
            mean_queue_seconds=delta["queue_time"] / delta["queued"] if delta["queued"] else 0.0,
            num_steps_kv_blocked=delta["kv_blocked"],
            num_steps_seq_capped=delta["seq_capped"],
            prefix_cache_queried_tokens=delta["prefix_queried"],
            prefix_cache_hit_tokens=delta["prefix_hit"],
            busy_seconds=delta["busy"],
        )


def snapshot_stats(scheduler: SchedulerState, with_queue_times: bool) -> SchedulerStats:
    """The scheduler's queues, KV pools and counters now (see Scheduler.stats)."""
    counters = scheduler.counters
    steps = max(counters.num_steps, 1)
    kv = scheduler.kv
    prefix = kv.prefix_stats
    waiting = scheduler.policy.waiting_requests()
    # Never admitted (a requeued request was admitted before).
    arrivals = [request.arrival_time for request in waiting if request.first_scheduled_time is None]
    return SchedulerStats(
        num_running=len(scheduler.running),
        num_waiting=len(waiting),
        num_swapped=len(scheduler.swapped),
        num_held=len(scheduler.handoffs.held),
        num_receiving=len(scheduler.handoffs.receiving),
        num_kv_handoffs_pending=len(scheduler.handoffs.held) + len(scheduler.handoffs.receiving),
        num_queued_prefill_tokens=_num_queued_prefill_tokens(scheduler, waiting),
        num_kv_blocks_total=kv.pool.num_blocks,
        num_kv_blocks_used=kv.num_used_blocks,
        num_kv_blocks_free=kv.num_free_blocks + kv.num_set_aside,
        num_kv_blocks_fenced=kv.num_fenced_blocks,
        num_swap_blocks_used=kv.swap_pool.num_used,
        num_preemptions_recompute=counters.num_preemptions[PreemptionKind.RECOMPUTE],
        num_preemptions_swap=counters.num_preemptions[PreemptionKind.SWAP],
        num_swapped_blocks_out=counters.num_swapped_blocks_out,
        num_steps=counters.num_steps,
        num_tokens_last_step=counters.num_tokens_last_step,
        num_tokens_scheduled_total=counters.num_tokens_total,
        mean_tokens_per_step=counters.num_tokens_total / steps,
        mean_seqs_per_step=counters.num_seqs_total / steps,
        kv_memory_efficiency=counters.kv_efficiency_total / steps,
        num_finished=counters.num_finished,
        mean_queue_time=counters.queue_time_total / max(counters.num_queued, 1),
        queue_times=tuple(counters.queue_times) if with_queue_times else (),
        recent=scheduler.recent_stats(),
        oldest_queued_seconds=time.monotonic() - min(arrivals) if arrivals else 0.0,
        prefix_caching=kv.enable_prefix_caching,
        num_kv_blocks_cached=kv.num_cached_blocks,
        num_kv_blocks_evictable=kv.num_evictable_blocks,
        num_kv_blocks_evicted=kv.pool.num_evicted,
        prefix_cache_queried_tokens=prefix.num_queried_tokens,
        prefix_cache_hit_tokens=prefix.num_hit_tokens,
        prefix_cache_received_blocks=prefix.num_received_blocks_queried,
        prefix_cache_reused_blocks=prefix.num_received_blocks_hit,
        num_kv_landed=scheduler.handoffs.num_landed,
        kv_copy_bytes_per_s=scheduler.cost_model.swap_bytes_per_second,
        **_tier_stats(kv, scheduler.cost_model.bytes_per_block),
    )


def _tier_stats(kv: KVCacheManager, bytes_per_block: int) -> dict[str, float]:
    """The host tier's statistics (engine/kv/host_tier.py); none without it."""
    tier = kv.tier
    if tier is None:
        return {}
    prefix = kv.prefix_stats
    return dict(num_kv_offload_blocks_total=kv.num_offload_blocks,
                num_kv_offload_blocks_cached=kv.swap_pool.num_cached,
                prefix_cache_host_hit_tokens=prefix.num_host_hit_tokens,
                prefix_cache_host_reused_blocks=prefix.num_received_blocks_host_hit,
                kv_offload_written_blocks=tier.num_written,
                kv_offload_reloaded_bytes=(prefix.num_host_hit_tokens // kv.block_size
                                           + prefix.num_received_blocks_host_hit) * bytes_per_block,
                kv_offload_reload_seconds=tier.reload_seconds,
                num_kv_offload_evicted=kv.swap_pool.num_evicted)


def _num_queued_prefill_tokens(scheduler: SchedulerState, waiting: list[Request]) -> int:
    """Prompt (or recompute) tokens not yet computed: waiting requests (but what the prefix
    cache held of them when last looked up: at arrival, or an admission attempt) and
    running chunks."""
    queued = 0
    for request in waiting:
        if not request.kv_remote:  # a kv_remote request's prompt arrives computed
            queued += request.num_tokens - request.num_cached_estimate
    for request in scheduler.running:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > 1:
            queued += remaining
    return queued
