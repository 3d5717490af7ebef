"""The engine's step-time model: what a step costs, so that a gateway can predict waits.

- decode: a decode-only step (no prefill token) of n sequences takes about
  `base_s + per_seq_s * n` seconds. `DecodeStepFit` fits the line by least squares
  over the last DECODE_WINDOW such steps, its slope ridged toward a prior (what
  calibration measured): a window where every step ran the same batch says nothing
  about the slope, so it keeps the prior's and moves only the level. Both
  coefficients are clamped at zero.
- prefill: seconds per prompt token, the preemption cost model's moving average over
  steps that are mostly prefill (engine/preemption.py).

A prefill step's seconds are those the engine times it by (ModelRunnerOutput.seconds:
on CUDA the device's time; on CPU the host's). A decode step's are the whole
`LLMEngine.step` call that reported it (scheduling and outputs too: what a stream waits
between tokens), or the device's time if longer (overlapped, the host may return early).

`calibrate_step_time` measures both on an idle engine before it serves, so that the
first requests (a burst arriving at once) are admitted on a measured model.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from engine.block_pool import cdiv
from engine.sampling_params import SamplingParams
from engine.scheduler.stats import SchedulerCounters

if TYPE_CHECKING:
    from engine.engine import LLMEngine
    from engine.model_runner import ModelRunnerOutput
    from engine.preemption import PreemptionCostModel
    from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

DECODE_WINDOW = 256  # decode-only steps the fit spans
# The engine learns the prefill rate from steps of at least this many prefill tokens.
MIN_PREFILL_SAMPLE_TOKENS = 64
# Calibration: the larger decode batch, the decode steps taken at each batch size (at
# least MIN, more up to MAX while within the phase's budget), and the longest prefill.
CALIBRATION_BATCH = 32
MIN_CALIBRATION_STEPS = 2
MAX_CALIBRATION_STEPS = 8
MAX_CALIBRATION_PREFILL = 512
DECODE_PHASE_BUDGET_S = 0.1
PREFILL_BUDGET_S = 0.15
_REQUEST_ID = "step-time-calibration"


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

    def observe(self, output: ModelRunnerOutput, scheduled: SchedulerOutput, wall_s: float) -> None:
        """Learn from a finished step, scheduled as `scheduled`, reported by a
        `LLMEngine.step` call that took `wall_s` seconds so far: the prefill rate from a step
        that is mostly prefill, the decode line from a decode-only one."""
        seconds = output.seconds - output.swap_seconds
        num_prefill = output.num_prefill_tokens
        if num_prefill >= MIN_PREFILL_SAMPLE_TOKENS and num_prefill >= 0.9 * scheduled.total_num_scheduled_tokens:
            self.cost_model.observe_prefill(num_prefill, seconds)
        elif num_prefill == 0 and scheduled.requests:
            self.decode.observe(len(scheduled.requests), max(seconds, wall_s - output.swap_seconds))

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


def calibrate_step_time(engine: LLMEngine) -> float:
    """Measure the step-time model on an idle engine, through the engine itself: decode
    steps at batch 1 and at min(max_num_seqs, CALIBRATION_BATCH) (the fit's prior), then
    one prefill step (the prefill rate). Short random prompts, greedy, sized to fit the
    KV cache and bounded in time (a few tenths of a second on a CPU).

    Leaves no trace but the model: every request is ended and its blocks freed (the free
    list back in a fresh pool's order), the prefix cache is not fed, and the scheduler's
    counters are as they were. Returns the seconds it took."""
    started = time.perf_counter()
    scheduler, kv = engine.scheduler, engine.kv_manager
    assert not scheduler.has_unfinished_requests(), "calibrate an idle engine"
    counters, prefix_caching = scheduler.counters, kv.enable_prefix_caching
    scheduler.counters = SchedulerCounters(kv.prefix_stats)
    kv.enable_prefix_caching = False
    engine.step_time.decode.samples.clear()  # the warm-up's steps, first-call costs and all
    rng = random.Random(0)
    try:
        config = scheduler.config
        _measure_decode(engine, 1, rng)
        batch = min(config.max_num_seqs, CALIBRATION_BATCH)
        if batch > 1:
            _measure_decode(engine, batch, rng)
        line = engine.step_time.decode.adopt_samples_as_prior()
        _measure_prefill(engine, line.seconds(batch) / batch, rng)
    finally:
        scheduler.counters = counters
        kv.enable_prefix_caching = prefix_caching
        kv.pool.sort_free()
    seconds = time.perf_counter() - started
    logger.info("step-time model calibrated in %.2f s: decode step %.2f ms + %.3f ms per sequence, "
                "prefill %.1f us per token", seconds, line.base_s * 1e3, line.per_seq_s * 1e3,
                engine.cost_model.measured_prefill_seconds_per_token * 1e6)
    return seconds


def _measure_decode(engine: LLMEngine, num_seqs: int, rng: random.Random) -> None:
    """Decode steps of `num_seqs` sequences into the decode fit's window, as many as
    MAX_CALIBRATION_STEPS or DECODE_PHASE_BUDGET_S allow."""
    kv = engine.kv_manager
    # One-token prompts: their first step is a decode step as well (no prefill token).
    prompt_len = 1
    blocks_each = cdiv(prompt_len + MAX_CALIBRATION_STEPS + 1, kv.block_size) + 1
    num_seqs = min(num_seqs, kv.num_free_blocks // blocks_each)
    if num_seqs == 0:
        return  # a cache too small to calibrate in: the model is learned as the engine serves
    params = SamplingParams(temperature=0.0, max_tokens=MAX_CALIBRATION_STEPS + 1, ignore_eos=True)
    request_ids = [f"{_REQUEST_ID}-decode-{num_seqs}-{i}" for i in range(num_seqs)]
    for request_id in request_ids:
        engine.add_request(_random_prompt(engine, prompt_len, rng), params, request_id=request_id)
    fit = engine.step_time.decode
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        taken = sum(1 for size, _ in fit.samples if size == num_seqs)
        if taken >= MAX_CALIBRATION_STEPS or (
                taken >= MIN_CALIBRATION_STEPS and time.perf_counter() - started > DECODE_PHASE_BUDGET_S):
            break
        engine.step()
    for request_id in reversed(request_ids):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def _measure_prefill(engine: LLMEngine, seconds_per_token_guess: float, rng: random.Random) -> None:
    """One prefill step, as long as fits the step's budget, the KV cache and
    PREFILL_BUDGET_S (by `seconds_per_token_guess`): the prefill rate's first sample."""
    config = engine.scheduler.config
    kv = engine.kv_manager
    num_tokens = min(MAX_CALIBRATION_PREFILL, config.max_num_batched_tokens,
                     config.long_prefill_token_threshold or config.max_num_batched_tokens,
                     engine.max_model_len - 1, kv.num_free_blocks * kv.block_size)
    if seconds_per_token_guess > 0:
        num_tokens = min(num_tokens, max(MIN_PREFILL_SAMPLE_TOKENS, int(PREFILL_BUDGET_S / seconds_per_token_guess)))
    if num_tokens < MIN_PREFILL_SAMPLE_TOKENS:
        return  # too short to learn from: the rate stays unknown until a long prefill runs
    engine.add_request(_random_prompt(engine, num_tokens, rng),
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                       request_id=f"{_REQUEST_ID}-prefill")
    while engine.has_unfinished_requests():
        engine.step()


def _random_prompt(engine: LLMEngine, num_tokens: int, rng: random.Random) -> list[int]:
    return [rng.randrange(engine.vocab_size) for _ in range(num_tokens)]
