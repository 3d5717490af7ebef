"""The step-time model (engine/runner/step_time.py): the decode line's fit, the prefill rate, the
calibration a worker runs at start, and what the worker publishes of them."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest
import torch

from baton.runtime.settings import PrefillWorkerSettings
from baton.runtime.worker import build_engine
from baton.wire import stats_convert
from baton.wire.records import WorkerStats
from engine.calibration import calibrate_step_time
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.runner.step_time import DECODE_WINDOW, DecodeStepFit, StepLine, fit_line
from engine.sampling_params import SamplingParams
from engine.scheduler.preemption import PreemptionCostModel
from prefill_worker.server import PrefillWorkerService
from tests.support.tiny_models import make_tiny_model


# ------------------------------------------------------------------------ the fit
def line_samples(line: StepLine, sizes: list[int]) -> list[tuple[int, float]]:
    return [(n, line.seconds(n)) for n in sizes]


def test_an_exact_line_is_recovered():
    truth = StepLine(0.004, 0.0003)
    rng = random.Random(0)
    sizes = [rng.randint(1, 64) for _ in range(DECODE_WINDOW)]
    base, per_seq = fit_line(line_samples(truth, sizes))
    assert base == pytest.approx(truth.base_s, rel=1e-9) and per_seq == pytest.approx(truth.per_seq_s, rel=1e-9)
    # A prior off by half weighs little against a window spread over many batch sizes
    # (as much as calibration's two steps at batch 1 and two at batch 32).
    fit = DecodeStepFit()
    fit.set_prior(StepLine(0.002, 0.00015), weight=31**2)
    for n, seconds in line_samples(truth, sizes):
        fit.observe(n, seconds)
    assert fit.line().per_seq_s == pytest.approx(truth.per_seq_s, rel=0.02)
    for n in (1, 16, 64):
        assert fit.line().seconds(n) == pytest.approx(truth.seconds(n), rel=0.02)


def test_a_window_of_one_batch_size_keeps_the_prior_slope_and_moves_the_level():
    fit = DecodeStepFit()
    assert fit.line() == StepLine(0.0, 0.0)  # nothing known
    fit.set_prior(StepLine(0.002, 0.0005), weight=100.0)
    assert fit.line() == StepLine(0.002, 0.0005)  # the prior alone, before any step
    for _ in range(50):
        fit.observe(8, 0.010)  # slower than the prior says (0.006)
    base, per_seq = fit.line()
    assert per_seq == pytest.approx(0.0005)
    assert base + per_seq * 8 == pytest.approx(0.010)
    # Without a prior, such a window gives a flat line at its level.
    assert fit_line([(8, 0.010)] * 5) == pytest.approx(StepLine(0.010, 0.0))


def test_negative_coefficients_are_clamped():
    # Steps faster at larger batches (noise): no slope, the mean level.
    falling = [(1, 0.010), (16, 0.008), (32, 0.006)]
    assert fit_line(falling) == pytest.approx(StepLine(0.008, 0.0))
    # A steep line whose intercept falls below zero: the best line through the origin.
    steep = [(10, 0.001), (20, 0.012), (30, 0.023)]
    base, per_seq = fit_line(steep)
    assert base == 0.0 and per_seq > 0
    assert per_seq == pytest.approx(sum(x * y for x, y in steep) / sum(x * x for x, _ in steep))


def test_the_window_keeps_the_last_steps_and_calibration_adopts_its_medians():
    fit = DecodeStepFit(window=4)
    for seconds in (1.0, 1.0, 0.002, 0.002, 0.002, 0.002):
        fit.observe(1, seconds)
    assert fit.line() == pytest.approx(StepLine(0.002, 0.0))  # the first two slid out
    fit.observe(0, 1.0)  # an empty step: nothing to learn
    assert len(fit.samples) == 4 and fit.samples[-1] == (1, 0.002)

    fit = DecodeStepFit()
    for seconds in (0.010, 0.011, 0.5):  # an outlier does not move the median
        fit.observe(1, seconds)
    for seconds in (0.041, 0.042):
        fit.observe(32, seconds)
    prior = fit.adopt_samples_as_prior()
    assert not fit.samples and fit.prior == prior
    assert prior.seconds(1) == pytest.approx(0.011) and prior.seconds(32) == pytest.approx(0.041)
    assert fit.prior_weight > 0


def test_decode_steps_with_proposals_give_a_proposals_cost():
    from engine.runner.model_runner import ModelRunnerOutput
    from engine.runner.step_time import StepTimeModel
    from engine.scheduler import SchedulerOutput

    model = StepTimeModel(PreemptionCostModel(bytes_per_block=1))
    one_row = SchedulerOutput(requests=[object()], num_scheduled_tokens=[1], total_num_scheduled_tokens=1)
    # Batch 1 only: the decode line has no slope, so a proposal's cost is unknown (0) ...
    for _ in range(4):
        model.observe(ModelRunnerOutput([], [], None, seconds=0.020), one_row, 0.020)
    assert model.entry_line().per_seq_s == 0.0
    # ... until steps check proposals: 5 ms each on top of a 20 ms step.
    for num_spec in (1, 4, 2, 3):
        output = ModelRunnerOutput([], [], None, seconds=0.020 + 0.005 * num_spec,
                                   sample_counts=(1 + num_spec,))
        model.observe(output, one_row, 0.0)
    line = model.entry_line()
    assert line.per_seq_s == pytest.approx(0.005) and line.seconds(1) == pytest.approx(0.020)
    assert model.decode.line().seconds(1) == pytest.approx(0.020)  # the decode line saw plain steps only


def test_the_first_prefill_measurement_replaces_the_default_guess():
    model = PreemptionCostModel(bytes_per_block=1, smoothing=0.2)
    assert model.measured_prefill_seconds_per_token == 0.0  # the guess is not published
    model.observe_prefill(100, 0.1)
    assert model.measured_prefill_seconds_per_token == pytest.approx(1e-3)
    model.observe_prefill(100, 0.2)  # later ones average in
    assert model.measured_prefill_seconds_per_token == pytest.approx(1.2e-3)


def test_worker_stats_predict_with_the_published_model():
    unknown = WorkerStats(worker_id="w", role="decode", serving=True)
    assert unknown.decode_step_s(8) is None and unknown.prefill_s(100) is None
    stats = replace(unknown, decode_step_base_s=0.01, decode_step_per_seq_s=0.001, prefill_s_per_token=2e-4)
    assert stats.decode_step_s(8) == pytest.approx(0.018)
    assert stats.prefill_s(100) == pytest.approx(0.02)
    again = stats_convert.worker_stats_from_pb(stats_convert.worker_stats_to_pb(stats))
    assert (again.decode_step_base_s, again.decode_step_per_seq_s, again.prefill_s_per_token) == (0.01, 0.001, 2e-4)


# ----------------------------------------------------------------- calibration
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-step-time"), "llama", 4, 2, 16, True,
                           dtype=torch.float32)[1]


def config(model_dir: str, calibrate: bool = True, overlap: bool = False, **scheduler) -> EngineConfig:
    return EngineConfig(
        model=model_dir, dtype=torch.float32, overlap_scheduling=overlap, calibrate_step_time=calibrate,
        cache=CacheConfig(block_size=4, num_kv_blocks=96, num_swap_blocks=8),
        scheduler=SchedulerConfig(**{"max_num_batched_tokens": 256, "max_num_seqs": 32, **scheduler}),
    )


def counts(engine) -> dict:
    """What the stats say besides the step-time model and the clock."""
    stats = engine.get_metrics()
    recent = stats.recent
    return {
        **{name: getattr(stats, name) for name in (
            "num_running", "num_waiting", "num_swapped", "num_held", "num_receiving", "num_queued_prefill_tokens",
            "num_kv_blocks_used", "num_kv_blocks_free", "num_kv_blocks_fenced", "num_swap_blocks_used",
            "num_preemptions_recompute", "num_preemptions_swap", "num_steps", "num_tokens_last_step",
            "num_tokens_scheduled_total", "num_finished", "num_kv_blocks_cached", "num_kv_blocks_evictable",
            "num_kv_blocks_evicted", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens")},
        "num_queue_times": len(stats.queue_times),
        "recent": (recent.num_steps, recent.num_admissions, recent.num_queued, recent.mean_batch_size),
    }


@pytest.mark.parametrize("overlap", [False, True])
def test_calibration_measures_the_model_and_leaves_no_trace(tiny, overlap):
    plain = build_engine(config(tiny, calibrate=False, overlap=overlap))
    calibrated = build_engine(config(tiny, overlap=overlap))
    stats = calibrated.get_metrics()
    assert stats.decode_step_base_s + stats.decode_step_per_seq_s > 0 and stats.prefill_s_per_token > 0
    assert counts(calibrated) == counts(plain)
    assert plain.get_metrics().prefill_s_per_token == 0.0  # the warm-up prefills too little to learn from
    calibrated.check_integrity()
    # The pool hands out ascending runs again, as a fresh one does.
    for engine in (plain, calibrated):
        engine.add_request(list(range(3, 23)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                           request_id="first")
        engine.step()
        assert engine.kv_manager.get_block_ids("first") == [0, 1, 2, 3, 4]


def test_calibration_runs_plain_decode_steps_on_a_speculating_engine(tiny):
    from engine.config import SpeculativeConfig

    engine = build_engine(replace(config(tiny), speculative=SpeculativeConfig(method="ngram")))
    stats = engine.get_metrics()
    assert stats.decode_step_base_s + stats.decode_step_per_seq_s > 0
    assert engine.speculator is not None and engine.speculator.stats().num_checks == 0  # counts start with traffic
    assert stats.spec_num_checks == 0


def test_calibration_fits_small_engines(tiny):
    # A cache of a few blocks, one sequence at a time, a step budget too small to learn a prefill rate from.
    engine = build_engine(replace(config(tiny, max_num_seqs=1, max_num_batched_tokens=32),
                                  cache=CacheConfig(block_size=4, num_kv_blocks=8, num_swap_blocks=0)))
    stats = engine.get_metrics()
    assert stats.decode_step_base_s > 0 and stats.decode_step_per_seq_s == 0.0
    assert stats.prefill_s_per_token == 0.0
    assert stats.num_kv_blocks_used == 0
    assert calibrate_step_time(engine) > 0  # and again, on a served engine once idle
    assert engine.get_metrics().num_kv_blocks_used == 0


def test_a_worker_publishes_its_calibrated_model_at_start(tiny):
    settings = PrefillWorkerSettings(model=tiny, dtype="float32", block_size=4, num_kv_blocks=96, threads=1)
    service = PrefillWorkerService(settings)

    async def scenario() -> WorkerStats:
        await service.load("127.0.0.1:0")
        try:
            return await service.stats()
        finally:
            await service.stop()

    stats = asyncio.run(scenario())
    assert stats.serving and stats.num_kv_blocks_used == 0 and stats.num_kv_blocks_cached == 0
    assert stats.num_steps == 2 and stats.num_finished == 1  # the warm-up's, nothing more
    assert stats.decode_step_s(1) > 0 and stats.decode_step_s(32) >= stats.decode_step_s(1)
    assert stats.prefill_s(512) > 0
    published = stats_convert.worker_stats_from_pb(stats_convert.worker_stats_to_pb(stats))
    assert published.decode_step_s(8) == stats.decode_step_s(8) and published.prefill_s(64) == stats.prefill_s(64)
