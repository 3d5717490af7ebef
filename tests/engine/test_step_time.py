"""The step-time model (engine/runner/step_time.py): the decode line's fit, the prefill rate, the
calibration a worker runs at start, and what the worker publishes of them."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from baton.runtime.settings import PrefillWorkerSettings
from baton.runtime.worker import build_engine
from baton.wire import stats_convert
from baton.wire.records import WorkerStats
from engine.calibration import calibrate_step_time
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.runner.step_time import DECODE_WINDOW, DecodeStepFit, StepLine, StepSample, fit_line
from engine.sampling_params import SamplingParams
from engine.scheduler.preemption import PreemptionCostModel
from prefill_worker.server import PrefillWorkerService
from tests.support.tiny_models import make_tiny_model


# ------------------------------------------------------------------------ the fit
def line_samples(line: StepLine, shapes: list[tuple[int, int]]) -> list[StepSample]:
    return [StepSample(n, context, line.seconds(n, context)) for n, context in shapes]


def random_shapes(rng: random.Random, count: int) -> list[tuple[int, int]]:
    """Batch sizes of 1-64, each sequence 1-500 tokens long."""
    shapes = []
    for _ in range(count):
        n = rng.randint(1, 64)
        shapes.append((n, n * rng.randint(1, 500)))
    return shapes


def test_an_exact_line_is_recovered():
    truth = StepLine(0.004, 0.0003, 2e-7)
    rng = random.Random(0)
    shapes = random_shapes(rng, DECODE_WINDOW)
    fitted = fit_line(line_samples(truth, shapes))
    assert fitted == pytest.approx(truth, rel=1e-6)
    # A prior off by half weighs little against a window spread over many shapes (as much
    # as calibration's steps at batch 1, at batch 32 and at long contexts).
    fit = DecodeStepFit()
    fit.set_prior(StepLine(0.002, 0.00015, 1e-7), weights=(31**2, 8192**2))
    for sample in line_samples(truth, shapes):
        fit.observe(sample.num_seqs, sample.seconds, sample.num_context_tokens)
    assert fit.line().per_seq_s == pytest.approx(truth.per_seq_s, rel=0.02)
    assert fit.line().per_token_s == pytest.approx(truth.per_token_s, rel=0.02)
    for n, context in ((1, 1), (16, 2000), (64, 30000)):
        assert fit.line().seconds(n, context) == pytest.approx(truth.seconds(n, context), rel=0.02)


def test_a_window_of_one_batch_size_keeps_the_prior_slope_and_moves_the_level():
    fit = DecodeStepFit()
    assert fit.line() == StepLine(0.0, 0.0)  # nothing known
    prior = StepLine(0.002, 0.0005, 1e-6)
    fit.set_prior(prior, weights=(100.0, 1e4))
    assert fit.line() == prior  # the prior alone, before any step
    for _ in range(50):
        fit.observe(8, 0.010, 80)  # slower than the prior says (0.00608)
    base, per_seq, per_token = fit.line()
    assert (per_seq, per_token) == pytest.approx((0.0005, 1e-6))
    assert fit.line().seconds(8, 80) == pytest.approx(0.010)
    # Without a prior, such a window gives a flat line at its level.
    assert fit_line([StepSample(8, 80, 0.010)] * 5) == pytest.approx(StepLine(0.010, 0.0, 0.0))


def test_a_batch_that_grows_its_contexts_teaches_the_per_token_cost():
    # A cold burst: 256 sequences decode together, each a token longer every step. The batch
    # does not move, so the per-sequence slope stays the prior's; the contexts do.
    truth = StepLine(0.001, 2e-5, 1.5e-7)
    fit = DecodeStepFit()
    fit.set_prior(StepLine(0.001, 2e-5, 0.0), weights=(31**2, 100.0**2))  # calibrated at short contexts only
    for step in range(DECODE_WINDOW):
        context = 256 * (64 + step)
        fit.observe(256, truth.seconds(256, context), context)
    assert fit.line() == pytest.approx(truth, rel=0.01)
    assert fit.line().seconds(256, 256 * 464) == pytest.approx(truth.seconds(256, 256 * 464), rel=0.01)


def test_negative_coefficients_are_clamped():
    # Steps faster at larger batches (noise): no slope, the mean level.
    falling = [StepSample(1, 0, 0.010), StepSample(16, 0, 0.008), StepSample(32, 0, 0.006)]
    assert fit_line(falling) == pytest.approx(StepLine(0.008, 0.0, 0.0))
    # A steep line whose intercept falls below zero: the best line through the origin.
    steep = [StepSample(10, 0, 0.001), StepSample(20, 0, 0.012), StepSample(30, 0, 0.023)]
    base, per_seq, _ = fit_line(steep)
    assert base == 0.0 and per_seq > 0
    assert per_seq == pytest.approx(sum(s.num_seqs * s.seconds for s in steep) / sum(s.num_seqs**2 for s in steep))
    # Longer contexts faster (noise): the per-token slope is dropped, the batch's kept.
    odd = [StepSample(1, 10, 0.002), StepSample(32, 320, 0.010), StepSample(32, 8000, 0.009)]
    _, per_seq, per_token = fit_line(odd)
    assert per_token == 0.0 and per_seq > 0
    # Batch and context in proportion, no prior: the batch takes the slope.
    together = [StepSample(n, 10 * n, 0.001 + 0.0002 * n) for n in (1, 8, 32)]
    assert fit_line(together) == pytest.approx(StepLine(0.001, 0.0002, 0.0))
    # A full batch's noise says its sequences cost less the more there are: that slope is
    # held at the prior's, not dropped to zero (a flat line would forecast a batch of 8 as
    # slow as one of 256), and the per-token slope is fitted beside it.
    prior = StepLine(0.001, 2e-5, 1.5e-7)
    noisy = [StepSample(n, 256 * 300 + 500 * step, prior.seconds(n, 256 * 300 + 500 * step) - 1e-3 * (n - 253))
             for step, n in enumerate([250, 256, 256, 250] * 8)]
    held = fit_line(noisy, prior, (31**2, 1e4))
    assert held.per_seq_s == pytest.approx(2e-5) and held.per_token_s == pytest.approx(1.5e-7, rel=0.05)


def test_the_window_keeps_the_last_steps_and_calibration_sets_the_prior():
    fit = DecodeStepFit(window=4)
    for seconds in (1.0, 1.0, 0.002, 0.002, 0.002, 0.002):
        fit.observe(1, seconds)
    assert fit.line() == pytest.approx(StepLine(0.002, 0.0, 0.0))  # the first two slid out
    fit.observe(0, 1.0)  # an empty step: nothing to learn
    assert len(fit.samples) == 4 and fit.samples[-1] == StepSample(1, 0, 0.002)

    # Calibration's shapes: batch 1, batch 32, batch 32 at long contexts, the fastest step of each.
    fit = DecodeStepFit()
    for n, context in ((1, 2), (32, 32), (32, 32 * 258)):
        fit.observe(n, 0.1, context)  # the steps calibration ran: the prior's weights
    prior = fit.adopt_prior([StepSample(1, 2, 0.010), StepSample(32, 32, 0.041), StepSample(32, 32 * 258, 0.071)])
    assert not fit.samples and fit.prior == prior
    assert prior.seconds(1, 2) == pytest.approx(0.010)
    assert prior.seconds(32, 32) == pytest.approx(0.041)
    assert prior.seconds(32, 32 * 258) == pytest.approx(0.071)
    assert prior.per_token_s > 0 and fit.prior_weights[0] > 0 and fit.prior_weights[1] > 0


def test_decode_steps_with_proposals_give_a_proposals_cost():
    from engine.runner.model_runner import ModelRunnerOutput
    from engine.runner.step_time import StepTimeModel
    from engine.scheduler import SchedulerOutput

    model = StepTimeModel(PreemptionCostModel(bytes_per_block=1))
    row = SimpleNamespace(num_computed_tokens=10)
    one_row = SchedulerOutput(requests=[row], num_scheduled_tokens=[1], total_num_scheduled_tokens=1)
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
    # A cache with room for calibration's long contexts (32 sequences of up to 512 tokens).
    large = CacheConfig(block_size=4, num_kv_blocks=4400, num_swap_blocks=8)
    plain = build_engine(replace(config(tiny, calibrate=False, overlap=overlap), cache=large))
    calibrated = build_engine(replace(config(tiny, overlap=overlap), cache=large))
    stats = calibrated.get_metrics()
    assert stats.decode_step_base_s + stats.decode_step_per_seq_s > 0 and stats.prefill_s_per_token > 0
    assert calibrated.step_time.decode.prior_weights[1] > 0  # its steps ran contexts of more than one length
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
