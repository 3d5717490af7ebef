"""The engine's step-time model: what a step costs, so that a gateway can predict waits.

- decode: a decode-only step (no prefill token) of n sequences takes about
  `base_s + per_seq_s * n` seconds. `DecodeStepFit` fits the line by least squares
  over the last DECODE_WINDOW such steps, its slope ridged toward a prior (what
  calibration measured): a window where every step ran the same batch says nothing
  about the slope, so it keeps the prior's and moves only the level. Both
  coefficients are clamped at zero.
- prefill: seconds per prompt token, the preemption cost model's moving average over
  steps that are mostly prefill (engine/scheduler/preemption.py).
- decode entries (speculative decoding): a decode step of e entries, a decoding row's one
  token each and one more per proposal it checks (engine/runner/forward_batch.py `decode_rows`),
  takes about `base_s + per_seq_s * e`: the same least squares over every decode-only
  step, proposals or not. Its slope is what one more proposal costs. Until the entries
  vary (and so give a slope) the decode line stands in for it.

A prefill step's seconds are those the engine times it by (ModelRunnerOutput.seconds:
on CUDA the device's time; on CPU the host's). A decode step's are the whole
`LLMEngine.step` call that reported it (scheduling and outputs too: what a stream waits
between tokens), or the device's time if longer (overlapped, the host may return early).

`engine.calibration.calibrate_step_time` measures both on an idle engine before it
serves, so that the first requests (a burst arriving at once) are admitted on a
measured model.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import TYPE_CHECKING, NamedTuple


if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunnerOutput
    from engine.scheduler import SchedulerOutput
    from engine.scheduler.preemption import PreemptionCostModel

logger = logging.getLogger(__name__)

DECODE_WINDOW = 256  # decode-only steps the fit spans
# The engine learns the prefill rate from steps of at least this many prefill tokens.
MIN_PREFILL_SAMPLE_TOKENS = 64


class StepLine(NamedTuple):
    """Seconds of a decode step of n sequences: base_s + per_seq_s * n."""

    base_s: float
    per_seq_s: float

    def seconds(self, num_seqs: int) -> float:
        return self.base_s + self.per_seq_s * num_seqs


def fit_line(samples: list[tuple[int, float]], prior: StepLine | None = None, prior_weight: float = 0.0) -> StepLine:
    """Least squares line through (num_seqs, seconds) samples, its slope ridged toward
    `prior`'s with `prior_weight` (in units of sum((x - mean x)^2) of the samples), both
    coefficients clamped at zero. No sample: the prior, else a zero line."""
    n = len(samples)
    if n == 0:
        return prior if prior is not None else StepLine(0.0, 0.0)
    prior_slope, weight = (prior.per_seq_s, prior_weight) if prior is not None else (0.0, 0.0)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in samples)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in samples)
    slope = (sxy + weight * prior_slope) / (sxx + weight) if sxx + weight > 0 else 0.0
    base = mean_y - slope * mean_x
    if slope < 0:
        return StepLine(mean_y, 0.0)
    if base < 0:  # the best line through the origin instead
        sxx0 = sum(x * x for x, _ in samples)
        sxy0 = sum(x * y for x, y in samples)
        return StepLine(0.0, max((sxy0 + weight * prior_slope) / (sxx0 + weight), 0.0))
    return StepLine(base, slope)


class StepTimeEstimate(NamedTuple):
    """The model as published (SchedulerStats, WorkerStats): 0.0 where not known."""

    decode_step_base_s: float
    decode_step_per_seq_s: float
    prefill_s_per_token: float


class StepTimeModel:
    """What the engine learns of its step times: the decode line, and the prefill rate of
    the preemption cost model, which it feeds."""

    def __init__(self, cost_model: PreemptionCostModel) -> None:
        self.cost_model = cost_model
        self.decode = DecodeStepFit()
        self.entries = DecodeStepFit()  # decode steps by entries (see the module's docstring)

    def observe(self, output: ModelRunnerOutput, scheduled: SchedulerOutput, wall_s: float) -> None:
        """Learn from a finished step, scheduled as `scheduled`, reported by a
        `LLMEngine.step` call that took `wall_s` seconds so far: the prefill rate from a step
        that is mostly prefill, the decode line from a decode-only one."""
        seconds = output.seconds - output.swap_seconds
        num_prefill = output.num_prefill_tokens
        if num_prefill >= MIN_PREFILL_SAMPLE_TOKENS and num_prefill >= 0.9 * scheduled.total_num_scheduled_tokens:
            self.cost_model.observe_prefill(num_prefill, seconds)
        elif num_prefill == 0 and scheduled.requests:
            seconds = max(seconds, wall_s - output.swap_seconds)
            if not output.num_spec_tokens:
                self.decode.observe(len(scheduled.requests), seconds)
            self.entries.observe(len(scheduled.requests) + output.num_spec_tokens, seconds)

    def entry_line(self) -> StepLine:
        """Seconds of a decode step by its entries (see the module's docstring): the fit over
        decode steps with and without proposals once it has a slope, else the decode line."""
        line = self.entries.line()
        return line if line.per_seq_s > 0 else self.decode.line()

    def estimate(self) -> StepTimeEstimate:
        line = self.decode.line()
        return StepTimeEstimate(line.base_s, line.per_seq_s, self.cost_model.measured_prefill_seconds_per_token)


class DecodeStepFit:
    """The decode line over the last `window` decode-only steps (see the module's docstring)."""

    def __init__(self, window: int = DECODE_WINDOW) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)  # (num_seqs, seconds)
        self.prior: StepLine | None = None
        self.prior_weight = 0.0  # how much the prior's slope counts against the window's spread
        self._line: StepLine | None = None  # the fit, until the next sample

    def observe(self, num_seqs: int, seconds: float) -> None:
        if num_seqs > 0 and seconds > 0:
            self.samples.append((num_seqs, seconds))
            self._line = None

    def set_prior(self, prior: StepLine, weight: float) -> None:
        self.prior, self.prior_weight = prior, weight
        self._line = None

    def line(self) -> StepLine:
        """The fit now (a zero line: no decode step seen and no prior)."""
        if self._line is None:
            self._line = fit_line(list(self.samples), self.prior, self.prior_weight)
        return self._line

    def adopt_samples_as_prior(self) -> StepLine:
        """Make the window's samples the prior, and start the window over (calibration's
        end). The prior is the line through the median seconds at each batch size (the
        lower of two middle ones: a step slowed by a moment descheduled counts less), and
        counts as much as those samples' spread in batch size."""
        samples = list(self.samples)
        by_size: dict[int, list[float]] = {}
        for num_seqs, seconds in samples:
            by_size.setdefault(num_seqs, []).append(seconds)
        medians = [(num_seqs, statistics.median_low(times)) for num_seqs, times in sorted(by_size.items())]
        mean_x = sum(x for x, _ in samples) / len(samples) if samples else 0.0
        self.set_prior(fit_line(medians), sum((x - mean_x) ** 2 for x, _ in samples))
        self.samples.clear()
        return self.line()
