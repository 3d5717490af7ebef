"""Calibrating the step-time model (engine/runner/step_time.py) on an idle engine before it
serves: decode steps at two batch sizes, one prefill step, and decode steps at long
contexts, through the engine itself, so that the first requests (a burst arriving at
once) are admitted on a measured model."""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from engine.kv.manager import cdiv
from engine.runner.step_time import MIN_PREFILL_SAMPLE_TOKENS, StepSample, fit_line
from engine.sampling_params import SamplingParams
from engine.scheduler.stats import SchedulerCounters

if TYPE_CHECKING:
    from engine.engine import LLMEngine

logger = logging.getLogger(__name__)

# Calibration: the larger decode batch (at 256 on SmolLM2, six workers calibrating on two
# cores took 8-12 s each), the decode steps taken in each phase (at least MIN, more up to
# MAX while within the phase's budget), the longest prefill, and the contexts of the
# long-context phase (its prompts' prefill within its budget; shorter than MIN, it is
# skipped: attention over them hides in a step's other costs).
CALIBRATION_BATCH = 32
MIN_CALIBRATION_STEPS = 2
MAX_CALIBRATION_STEPS = 8
MAX_CALIBRATION_PREFILL = 512
MAX_CALIBRATION_CONTEXT = 512
MIN_CALIBRATION_CONTEXT = 128
DECODE_PHASE_BUDGET_S = 0.1
PREFILL_BUDGET_S = 0.15
CONTEXT_PREFILL_BUDGET_S = 0.15
_REQUEST_ID = "step-time-calibration"


def calibrate_step_time(engine: LLMEngine) -> float:
    """Measure the step-time model on an idle engine, through the engine itself: decode
    steps at batch 1 and at min(max_num_seqs, CALIBRATION_BATCH), one prefill step (the
    prefill rate), then decode steps with contexts of up to MAX_CALIBRATION_CONTEXT
    tokens each: the fastest step of each shape makes the fit's prior (`_measure_shapes`).
    Random prompts, greedy, sized to fit the KV cache and bounded in time (a few tenths of
    a second on a CPU).

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
    # Plain decode steps only: speculation (its counts, its rows' acceptance) starts with the traffic.
    speculator, engine.speculator = engine.speculator, None
    rng = random.Random(0)
    try:
        line = engine.step_time.decode.adopt_prior(_measure_shapes(engine, rng))
    finally:
        engine.speculator = speculator
        scheduler.counters = counters
        kv.enable_prefix_caching = prefix_caching
        kv.pool.sort_free()
    seconds = time.perf_counter() - started
    logger.info("step-time model calibrated in %.2f s: decode step %.2f ms + %.3f ms per sequence "
                "+ %.2f us per context token, prefill %.1f us per token", seconds, line.base_s * 1e3,
                line.per_seq_s * 1e3, line.per_token_s * 1e6,
                engine.cost_model.measured_prefill_seconds_per_token * 1e6)
    return seconds


def _measure_shapes(engine: LLMEngine, rng: random.Random) -> list[StepSample]:
    """The fastest decode step of each shape calibration measures (batch 1, the larger
    batch, and long contexts at as large a batch as CONTEXT_PREFILL_BUDGET_S prefills),
    and the prefill rate between them. A step is
    only ever slowed by the moments its process waited for a core (a worker calibrates as
    the deployment's other processes start), so the fastest is the shape's cost; and if
    the long contexts ran no slower than the short ones, which attention over them
    forbids, the two were measured at moments unlike each other: they are measured again."""
    config = engine.scheduler.config
    fastest: dict[tuple[int, int], StepSample] = {}

    def measure(num_seqs: int, prompt_len: int) -> None:
        sample = _measure_decode(engine, num_seqs, prompt_len, rng)
        key = (num_seqs, prompt_len)
        if sample is not None and (key not in fastest or sample.seconds < fastest[key].seconds):
            fastest[key] = sample

    measure(1, 1)
    batch = min(config.max_num_seqs, CALIBRATION_BATCH)
    if batch > 1:
        measure(batch, 1)
    short = fastest.get((batch, 1))
    _measure_prefill(engine, short.seconds / batch if short is not None else 0.0, rng)
    prefill_rate = engine.cost_model.measured_prefill_seconds_per_token
    if prefill_rate <= 0 or batch == 1:
        return list(fastest.values())
    # Long contexts before many sequences: attention over a few dozen tokens a sequence
    # hides in a step's other costs (dummy:tiny on a CPU: 256 rows of 64 tokens step as
    # fast as of 8), so the slope shows at hundreds.
    context = min(MAX_CALIBRATION_CONTEXT, engine.max_model_len - 2 * MAX_CALIBRATION_STEPS - 2)
    long_batch = max(1, min(batch, int(CONTEXT_PREFILL_BUDGET_S / (prefill_rate * context))))
    context = min(context, int(CONTEXT_PREFILL_BUDGET_S / (prefill_rate * long_batch)))
    if context >= MIN_CALIBRATION_CONTEXT:
        measure(long_batch, context)
        if fit_line(list(fastest.values())).per_token_s == 0:
            measure(batch, 1)
            measure(long_batch, context)
    return list(fastest.values())


def _measure_decode(engine: LLMEngine, num_seqs: int, prompt_len: int, rng: random.Random) -> StepSample | None:
    """Decode steps of `num_seqs` sequences of `prompt_len`-token prompts into the decode
    fit's window (a prompt of one token: its first step is a decode step as well), as
    many as MAX_CALIBRATION_STEPS or DECODE_PHASE_BUDGET_S allow once the prompts are in;
    returns the fastest (None: none ran)."""
    kv = engine.kv_manager
    # Room for the steps after the first prompts are in, while the last are prefilled.
    max_tokens = 2 * MAX_CALIBRATION_STEPS + 1
    blocks_each = cdiv(prompt_len + max_tokens, kv.block_size) + 1
    num_seqs = min(num_seqs, kv.num_free_blocks // blocks_each)
    if num_seqs == 0:
        return  # a cache too small to calibrate in: the model is learned as the engine serves
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request_ids = [f"{_REQUEST_ID}-decode-{num_seqs}x{prompt_len}-{i}" for i in range(num_seqs)]
    for request_id in request_ids:
        engine.add_request(_random_prompt(engine, prompt_len, rng), params, request_id=request_id)
    fit = engine.step_time.decode
    before = len(fit.samples)
    started = None
    while engine.has_unfinished_requests():
        taken = sum(1 for sample in list(fit.samples)[before:] if sample.num_seqs == num_seqs)
        if taken and started is None:
            started = time.perf_counter()  # the prompts are in: the phase's budget runs from here
        if taken >= MAX_CALIBRATION_STEPS or (
                taken >= MIN_CALIBRATION_STEPS and time.perf_counter() - started > DECODE_PHASE_BUDGET_S):
            break
        engine.step()
    for request_id in reversed(request_ids):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    # The phase's steps only: not those of part of its batch (as it ended, or as the first
    # prompts in decoded while the last were prefilled alone).
    phase = [sample for sample in list(fit.samples)[before:] if sample.num_seqs == num_seqs]
    while len(fit.samples) > before:
        fit.samples.pop()
    fit.samples.extend(phase)
    return min(phase, key=lambda sample: sample.seconds, default=None)


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
