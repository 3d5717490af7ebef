"""The scheduler: which requests run each step, with how many tokens.

    scheduler.py    Scheduler: queues, the running loop, swap-ins, preemption, handoff states
    policy.py       AdmissionPolicy: how waiting requests join the batch (the contract)
    continuous.py   ContinuousAdmission: aging order, whole prompt plus growth room must fit
    static.py       StaticAdmission: batch at a time, worst case reserved up front
    waiting.py      WaitingQueue: the aging heap of waiting requests
    output.py       SchedulerOutput: one step's work
    stats.py        counters, the recent window, SchedulerStats / RecentStats
"""

from engine.scheduler.output import SchedulerOutput
from engine.scheduler.scheduler import ADMISSION_POLICIES, Scheduler
from engine.scheduler.stats import RECENT_WINDOW_S, RecentStats, SchedulerStats

__all__ = [
    "ADMISSION_POLICIES",
    "RECENT_WINDOW_S",
    "RecentStats",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
]
