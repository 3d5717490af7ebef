"""Overlapped scheduling's bookkeeping: the step in flight, the frees it defers, and the
sampling that waits for it.

Overlapped, `LLMEngine.step` launches step N+1 before it reports step N's tokens, so
the host schedules and prepares the next step while the device runs this one:

    call k:    schedule N+1 | launch N+1 | complete N (wait, resolve, outputs)
    device:    ........ N ........ | ........ N+1 ........

Three things follow, and `Overlap` owns them:
- the step in flight, launched last and not yet completed (`step`);
- block frees: a request that step N ends has run once more in step N+1, which may
  still write into its blocks, so they go back to the pool only once N+1 has ended
  (KVCacheManager.defer_frees / free_deferred);
- grammar sampling: a row under a grammar samples N+1's token only once its matcher has
  seen N's, so that sampling is launched after N is completed (ModelRunner.sample_deferred).
A step that runs nothing on the device (only admissions, swaps) is completed at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv.manager import KVCacheManager
    from engine.outputs import KvReceive, RequestOutput
    from engine.runner.model_runner import LaunchedStep, ModelRunner
    from engine.scheduler import SchedulerOutput
    from engine.timeline import StepBatch


@dataclass(frozen=True, slots=True)
class UnresolvedStep:
    """A launched step, until its sampled tokens are back and resolved (Scheduler.resolve)."""

    scheduled: SchedulerOutput
    launched: LaunchedStep
    positions: list[int | None]  # Scheduler.advance: where each sampled token goes
    batch: StepBatch | None  # traced steps only
    kv_receives: list[KvReceive]


# Completes a step: (the step, the perf_counter its `step` call began at; None: untimed) -> outputs.
Complete = Callable[[UnresolvedStep, float | None], list["RequestOutput"]]


class Overlap:
    """The steps one `LLMEngine.step` call completes, and what waits on them. `enabled`:
    overlapped scheduling; off, each call completes the step it launched."""

    def __init__(self, enabled: bool, kv: KVCacheManager, runner: ModelRunner) -> None:
        self.enabled = enabled
        self.kv = kv
        self.runner = runner
        self.step: UnresolvedStep | None = None  # in flight: launched, not yet completed

    @property
    def launched_before(self) -> LaunchedStep | None:
        """What the next launch follows on the device (its rows' last tokens are there)."""
        return self.step.launched if self.step is not None else None

    def drain(self, complete: Complete) -> list[RequestOutput]:
        """Complete the step in flight now, for a step that must run plain (untimed: its
        time was the last call's)."""
        step, self.step = self.step, None
        assert step is not None, "nothing in flight to drain"
        self.kv.defer_frees(False)
        outputs = complete(step, None)
        self.kv.free_deferred()
        return outputs

    def turn(self, launched: UnresolvedStep | None, complete: Complete, started: float,
             plain: bool = False) -> list[RequestOutput]:
        """Complete what this call reports: plain (or not overlapping), `launched` itself;
        else the step in flight, `launched` taking its place (completed now too if it runs
        nothing on the device). Then the frees deferred behind the completed steps return
        to the pool, and `launched`'s deferred sampling starts."""
        overlap = self.enabled and not plain
        done = [launched]
        if overlap:
            done = [self.step]
            self.step = launched
            if launched is not None and not launched.scheduled.requests:
                done.append(launched)
                self.step = None
            self.kv.defer_frees(self.step is not None)
        outputs = [output for step in done if step is not None for output in complete(step, started)]
        if overlap:
            self.kv.free_deferred()  # freed while the steps just completed ran
        if launched is not None and launched.launched.deferred is not None:
            self.runner.sample_deferred(launched.launched)  # its grammars have seen the tokens just completed
        return outputs
