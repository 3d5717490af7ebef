"""The engine's step-time model: what a step costs, so that a gateway can predict waits.

- decode: a decode-only step (no prefill token) of n sequences whose contexts hold c
  tokens in all takes about `base_s + per_seq_s * n + per_token_s * c` seconds: the
  weights once, each row's share of them (sampling, the rows' activations), and
  attention over every row's keys. `DecodeStepFit` fits it by least squares over the
  last DECODE_WINDOW such steps, its slopes ridged toward a prior (what calibration
  measured): a window where every step ran the same batch says nothing about the
  per-sequence slope, so it keeps the prior's, and one whose contexts did not vary
  keeps the prior's per-token slope. Every coefficient is clamped at zero. Without the
  context term a line fitted on short contexts read a step of 256 rows of 464 tokens
  (dummy:tiny, one CPU thread) at 6.7 ms; it took 24.5.
- prefill: seconds per prompt token, the preemption cost model's moving average over
  steps that are mostly prefill (engine/scheduler/preemption.py).
- decode entries (speculative decoding): a decode step of e entries, a decoding row's one
  token each and one more per proposal it checks (engine/runner/forward_batch.py `decode_rows`),
  takes about `base_s + per_seq_s * e`: the same least squares over every decode-only
  step, proposals or not, contexts left out. Its slope is what one more proposal costs. Until the entries
  vary (and so give a slope) the decode line stands in for it.

A prefill step's seconds are those the engine times it by (ModelRunnerOutput.seconds:
on CUDA the device's time; on CPU the host's). A decode step's are the whole
`LLMEngine.step` call that reported it (scheduling and outputs too: what a stream waits
between tokens), or the device's time if longer (overlapped, the host may return early).

`engine.calibration.calibrate_step_time` measures both on an idle engine before it
serves (decode steps at two batch sizes, and at long contexts), so that the first
requests (a burst arriving at once) are admitted on a measured model.
"""

from __future__ import annotations

import logging
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
    """Seconds of a decode step of n sequences of c context tokens in all:
    base_s + per_seq_s * n + per_token_s * c."""

    base_s: float
    per_seq_s: float
    per_token_s: float = 0.0

    def seconds(self, num_seqs: int, num_context_tokens: int = 0) -> float:
        return self.base_s + self.per_seq_s * num_seqs + self.per_token_s * num_context_tokens


class StepSample(NamedTuple):
    """One decode step: its sequences, their context tokens in all, its seconds."""

    num_seqs: int
    num_context_tokens: int
    seconds: float


def fit_line(samples: list[StepSample], prior: StepLine | None = None,
             prior_weights: tuple[float, float] = (0.0, 0.0)) -> StepLine:
    """Least squares through the samples, the slopes ridged toward `prior`'s, each with its
    weight in `prior_weights` (per sequence, per token: in units of the samples' sum of
    squared deviations of that variable), every coefficient clamped at zero: a slope the
    samples would make negative, or cannot tell apart from the other, is held at the
    prior's (else at zero) and the rest refitted; a fit whose intercept falls below zero
    is refitted through the origin. No sample: the prior, else a zero line."""
    if not samples:
        return prior if prior is not None else StepLine(0.0, 0.0)
    priors = (prior.per_seq_s, prior.per_token_s) if prior is not None else (0.0, 0.0)
    weights = prior_weights if prior is not None else (0.0, 0.0)
    moments = _Moments.of(samples)
    # (the slopes fitted, the others' held values), the most fitted first.
    candidates = [((0, 1), (0.0, 0.0))] + [
        (free, held) for held in (priors, (0.0, 0.0)) for free in ((0,), (1,), ())]
    for free, held in candidates:
        fitted = _ridge(moments[0], free, held, priors, weights)
        if fitted is not None and fitted.base_s < 0:
            fitted = _ridge(moments[1], free, held, priors, weights)
        if fitted is not None:
            return fitted
    raise AssertionError("a line of zero slopes always fits")


class _Moments(NamedTuple):
    """What least squares reads of the samples: the means of batch size, context and
    seconds, and their cross sums of deviations from those means (about zero, for a
    line through the origin). Computed once, however many fits are then tried."""

    means: tuple[float, float]  # of batch size, of context
    mean_y: float
    cross: tuple[tuple[float, float], tuple[float, float]]  # [i][j]: sum of dev_i * dev_j
    with_y: tuple[float, float]  # [i]: sum of dev_i * dev_y

    @classmethod
    def of(cls, samples: list[StepSample]) -> tuple[_Moments, _Moments]:
        """About the means (a line with an intercept), and about zero (through the origin)."""
        n = len(samples)
        xs = [float(s.num_seqs) for s in samples]
        zs = [float(s.num_context_tokens) for s in samples]
        ys = [s.seconds for s in samples]
        sx, sz, sy = sum(xs), sum(zs), sum(ys)
        sxx, sxz, szz = sum(x * x for x in xs), sum(x * z for x, z in zip(xs, zs)), sum(z * z for z in zs)
        sxy, szy = sum(x * y for x, y in zip(xs, ys)), sum(z * y for z, y in zip(zs, ys))

        def about(mx: float, mz: float, my: float) -> _Moments:
            return cls((mx, mz), my, ((sxx - n * mx * mx, sxz - n * mx * mz), (sxz - n * mx * mz, szz - n * mz * mz)),
                       (sxy - n * mx * my, szy - n * mz * my))

        return about(sx / n, sz / n, sy / n), about(0.0, 0.0, 0.0)


def _ridge(m: _Moments, free: tuple[int, ...], held: tuple[float, float], priors: tuple[float, float],
           weights: tuple[float, float]) -> StepLine | None:
    """The ridge fit of the `free` slopes, the others at their `held` values; None where a
    slope is negative or the free variables cannot be told apart."""
    slopes = [0.0 if i in free else held[i] for i in (0, 1)]
    # Normal equations of the residual (seconds less the held slopes' part): (X'X + W) b = X'r + W b_prior.
    a = [[m.cross[i][j] + (weights[i] if i == j else 0.0) for j in free] for i in free]
    b = [m.with_y[i] - sum(slopes[j] * m.cross[i][j] for j in (0, 1)) + weights[i] * priors[i] for i in free]
    if len(free) == 2:
        det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
        if det <= 1e-9 * a[0][0] * a[1][1]:
            return None  # the two variables moved together: their slopes are not known apart
        slopes = [(b[0] * a[1][1] - b[1] * a[0][1]) / det, (a[0][0] * b[1] - a[1][0] * b[0]) / det]
    elif free:
        if a[0][0] <= 0:
            return None  # the variable did not move, and no prior holds its slope
        slopes[free[0]] = b[0] / a[0][0]
    if min(slopes) < 0:
        return None
    return StepLine(m.mean_y - slopes[0] * m.means[0] - slopes[1] * m.means[1], *slopes)


class StepTimeEstimate(NamedTuple):
    """The model as published (SchedulerStats, WorkerStats): 0.0 where not known."""

    decode_step_base_s: float
    decode_step_per_seq_s: float
    decode_step_per_context_token_s: float
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
                context = sum(request.num_computed_tokens for request in scheduled.requests)
                self.decode.observe(len(scheduled.requests), seconds, context)
            self.entries.observe(len(scheduled.requests) + output.num_spec_tokens, seconds)

    def entry_line(self) -> StepLine:
        """Seconds of a decode step by its entries (see the module's docstring): the fit over
        decode steps with and without proposals once it has a slope, else the decode line."""
        line = self.entries.line()
        return line if line.per_seq_s > 0 else self.decode.line()

    def estimate(self) -> StepTimeEstimate:
        line = self.decode.line()
        return StepTimeEstimate(line.base_s, line.per_seq_s, line.per_token_s,
                                self.cost_model.measured_prefill_seconds_per_token)


class DecodeStepFit:
    """The decode line over the last `window` decode-only steps (see the module's docstring)."""

    def __init__(self, window: int = DECODE_WINDOW) -> None:
        self.samples: deque[StepSample] = deque(maxlen=window)
        self.prior: StepLine | None = None
        # How much the prior's slopes count against the window's spread (per sequence, per token).
        self.prior_weights = (0.0, 0.0)
        self._line: StepLine | None = None  # the fit, until the next sample

    def observe(self, num_seqs: int, seconds: float, num_context_tokens: int = 0) -> None:
        if num_seqs > 0 and seconds > 0:
            self.samples.append(StepSample(num_seqs, num_context_tokens, seconds))
            self._line = None

    def set_prior(self, prior: StepLine, weights: tuple[float, float]) -> None:
        self.prior, self.prior_weights = prior, weights
        self._line = None

    def line(self) -> StepLine:
        """The fit now (a zero line: no decode step seen and no prior)."""
        if self._line is None:
            self._line = fit_line(list(self.samples), self.prior, self.prior_weights)
        return self._line

    def adopt_prior(self, points: list[StepSample]) -> StepLine:
        """Make the fit through `points` (calibration's: the fastest step of each shape it
        ran) the prior, and start the window over. Its slopes count as much as the
        window's samples (calibration's steps) spread in batch size and in context."""
        samples = list(self.samples)
        self.set_prior(fit_line(points), (_spread([s.num_seqs for s in samples]),
                                          _spread([s.num_context_tokens for s in samples])))
        self.samples.clear()
        return self.line()


def _spread(values: list[float]) -> float:
    """The sum of squared deviations from the mean."""
    mean = sum(values) / len(values) if values else 0.0
    return sum((v - mean) ** 2 for v in values)
