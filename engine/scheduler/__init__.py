"""The scheduler: which requests run each step, with how many tokens.

    scheduler.py    Scheduler: queues, the running loop, swap-ins, preemption, handoff ends
    handoff.py      KvHandoffs: HELD and RECEIVING requests (disaggregated serving), a component
    stopping.py     when a sampled token ends its request (EOS, stop tokens, grammar, length)
    policy.py       AdmissionPolicy: chooses the waiting requests to admit (the contract), AdmissionView
    continuous.py   ContinuousAdmission: queue order, whole prompt plus growth room must fit
    static.py       StaticAdmission: batch at a time, worst case reserved up front
    waiting.py      WaitingQueue: the heap of waiting requests (aged priority, then deadline)
    budget.py       the prompt tokens a step may take beside decoding rows (disaggregated serving)
    preemption.py   PreemptionCostModel: recompute or swap, from measured rates
    speculative.py  a decoding row's proposals in its step, and its table after the check
    prefix.py       PrefixMatcher: a request's cached prefix at admission; computed blocks into the cache
    output.py       SchedulerOutput: one step's work
    stats.py        counters, the recent window, SchedulerStats / RecentStats, SchedulerState
    integrity.py    check_integrity: every request in one queue, holding what its state allows

The names below are imported from their modules when first used, so reading the
stats records (as the wire layer does) does not load the scheduler itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_attributes

if TYPE_CHECKING:  # for type checkers only: never run
    from engine.scheduler.output import SchedulerOutput
    from engine.scheduler.scheduler import ADMISSION_POLICIES, Scheduler
    from engine.scheduler.stats import RECENT_WINDOW_S, SchedulerStats
    from engine.statistics import RecentStats

_LOCATIONS = {
    "ADMISSION_POLICIES": "engine.scheduler.scheduler",
    "Scheduler": "engine.scheduler.scheduler",
    "SchedulerOutput": "engine.scheduler.output",
    "RECENT_WINDOW_S": "engine.scheduler.stats",
    "RecentStats": "engine.statistics",
    "SchedulerStats": "engine.scheduler.stats",
}
__all__ = sorted(_LOCATIONS)


__getattr__ = lazy_attributes(__name__, _LOCATIONS)
