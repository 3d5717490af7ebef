"""Calibrating the step-time model (engine/runner/step_time.py) on an idle engine before it
serves: decode steps at two batch sizes and one prefill step, through the engine itself,
so that the first requests (a burst arriving at once) are admitted on a measured model."""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from engine.kv.manager import cdiv
from engine.runner.step_time import MIN_PREFILL_SAMPLE_TOKENS
from engine.sampling_params import SamplingParams
from engine.scheduler.stats import SchedulerCounters

if TYPE_CHECKING:
    from engine.engine import LLMEngine

logger = logging.getLogger(__name__)

# Calibration: the larger decode batch, the decode steps taken at each batch size (at
# least MIN, more up to MAX while within the phase's budget), and the longest prefill.
CALIBRATION_BATCH = 32
MIN_CALIBRATION_STEPS = 2
MAX_CALIBRATION_STEPS = 8
MAX_CALIBRATION_PREFILL = 512
DECODE_PHASE_BUDGET_S = 0.1
PREFILL_BUDGET_S = 0.15
_REQUEST_ID = "step-time-calibration"


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
    # Plain decode steps only: speculation (its counts, its rows' acceptance) starts with the traffic.
    speculator, engine.speculator = engine.speculator, None
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
        engine.speculator = speculator
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
