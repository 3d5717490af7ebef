"""What the engine reports for observability: a traced request's timeline events, the
timings on its last output, and the scheduler's recent-window statistics."""

from __future__ import annotations

import time

import pytest
import torch

from engine import SamplingParams
from engine.config import CacheConfig, PreemptionKind
from engine.scheduler import RECENT_WINDOW_S
from engine.timeline import (
    Admitted,
    FirstDecodeStep,
    KvReceived,
    KvReceiveFailed,
    Preempted,
    PrefillChunk,
    SwappedIn,
    TimelineEvent,
)
from tests.engine.test_engine import make_engine
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    return make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64)


def drain(engine, max_steps: int = 2000) -> dict[str, list]:
    """Step to the end; every output per request."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for output in engine.step().outputs:
            outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError("engine did not finish")


def events_of(outputs) -> list[TimelineEvent]:
    return [event for output in outputs for event in (output.events or [])]


def test_traced_request_records_chunks_batch_and_first_decode(tiny):
    _, model_dir = tiny
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(list(range(3, 43)), params, request_id="traced", trace=True)  # 40 tokens
    engine.add_request(list(range(5, 15)), params, request_id="plain")
    outputs = drain(engine)

    assert all(output.events is None for output in outputs["plain"])
    events = events_of(outputs["traced"])
    kinds = [type(event) for event in events]
    assert kinds[0] is Admitted
    assert events[0].queue_time_s >= 0 and events[0].readmitted is False
    chunks = [event for event in events if isinstance(event, PrefillChunk)]
    # 40 prompt tokens under a 16-token budget shared with a 10-token prompt.
    assert sum(chunk.num_tokens for chunk in chunks) == 40
    starts = [chunk.start for chunk in chunks]
    assert starts == sorted(starts) and starts[0] == 0
    for chunk in chunks:
        assert 1 <= chunk.batch.num_seqs <= 2
        assert chunk.num_tokens <= chunk.batch.num_tokens <= 16
        assert chunk.is_recompute is False
    steps = [chunk.batch.step_index for chunk in chunks]
    assert steps == sorted(set(steps))
    assert kinds.count(FirstDecodeStep) == 1
    assert kinds.index(FirstDecodeStep) > max(i for i, k in enumerate(kinds) if k is PrefillChunk)
    times = [event.time_ns for event in events]
    assert times == sorted(times)

    last = outputs["traced"][-1]
    assert last.finished and last.timings is not None
    assert last.timings.queue_time >= 0 and last.timings.prefill_time > 0
    assert last.timings.num_preemptions == 0
    assert all(output.timings is None for output in outputs["traced"][:-1])


def test_preemptions_are_events_and_recent_stats_count_them(tiny):
    _, model_dir = tiny
    # 12 blocks of 4 tokens: six requests growing to 20 tokens each cannot all fit.
    engine = make_engine(
        model_dir,
        cache=CacheConfig(block_size=4, num_kv_blocks=12, num_swap_blocks=8),
        max_num_batched_tokens=64,
        preemption_mode="swap",
    )
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for i in range(6):
        engine.add_request([3 + i] * 4, params, request_id=f"r{i}", trace=True)
    outputs = drain(engine)
    preempted = [event for request_outputs in outputs.values()
                 for event in events_of(request_outputs) if isinstance(event, Preempted)]
    assert preempted, "the starved cache must preempt"
    for event in preempted:
        assert event.kind in (PreemptionKind.SWAP, PreemptionKind.RECOMPUTE)
        assert event.num_blocks >= 1
    swap_ins = sum(isinstance(event, SwappedIn) for request_outputs in outputs.values()
                   for event in events_of(request_outputs))
    stats = engine.get_metrics(with_queue_times=False)
    assert swap_ins == stats.num_preemptions_swap
    assert len(preempted) == stats.num_preemptions_recompute + stats.num_preemptions_swap
    assert sum(o[-1].timings.num_preemptions for o in outputs.values()) == len(preempted)

    recent = stats.recent
    assert recent.num_steps == stats.num_steps
    assert recent.num_preemptions_swap == stats.num_preemptions_swap
    assert recent.num_preemptions_recompute == stats.num_preemptions_recompute
    assert recent.num_swapped_blocks_out == stats.num_swapped_blocks_out
    assert recent.mean_swap_blocks == pytest.approx(stats.num_swapped_blocks_out / max(stats.num_preemptions_swap, 1))
    # Entries: six first admissions plus every return from a preemption.
    assert recent.num_admissions == 6 + len(preempted)
    assert recent.preemption_rate == pytest.approx(len(preempted) / recent.num_admissions)
    assert recent.num_queued == 6
    assert recent.num_steps_kv_blocked > 0
    assert 0.5 < recent.mean_kv_usage <= 1.0
    assert 1.0 <= recent.mean_batch_size <= 6

    # After a window with no steps, the recent stats are empty (idle), the totals stay.
    later = engine.scheduler.recent_stats(now=engine.scheduler.counters.snapshots[-1][0] + RECENT_WINDOW_S + 1)
    assert later.num_steps == 0 and later.num_preemptions == 0 and later.mean_batch_size == 0.0
    assert later.seconds_since_last_step > RECENT_WINDOW_S


def test_received_request_has_no_prefill_time_and_a_first_decode_step(tiny):
    _, model_dir = tiny
    engine = make_engine(model_dir)
    prompt = list(range(4, 14))
    engine.add_prefilled_request(prompt, 7, SamplingParams(max_tokens=3, ignore_eos=True),
                                 request_id="moved", trace=True)
    step = engine.step()
    assert [receive.request_id for receive in step.kv_receives] == ["moved"]
    assert engine.complete_kv_receive("moved", True)
    outputs = drain(engine)["moved"]
    kinds = [type(event) for event in events_of(outputs)]
    assert kinds[:2] == [Admitted, KvReceived]
    assert PrefillChunk not in kinds and kinds.count(FirstDecodeStep) == 1
    timings = outputs[-1].timings
    assert timings.prefill_time is None and timings.queue_time >= 0


def test_recent_window_after_an_idle_spell_covers_only_the_new_steps(tiny):
    _, model_dir = tiny
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request([5, 6, 7], params, request_id="early")
    drain(engine)
    scheduler = engine.scheduler
    steps_before = scheduler.step_index
    # Pretend the engine then idled for ten minutes: shift every snapshot into the past.
    counters = scheduler.counters
    counters.snapshots = type(counters.snapshots)(
        ((t - 600.0, totals) for t, totals in counters.snapshots), maxlen=counters.snapshots.maxlen)
    assert scheduler.recent_stats().num_steps == 0
    engine.add_request([8, 9, 10], params, request_id="late")
    drain(engine)
    recent = scheduler.recent_stats()
    assert recent.num_steps == scheduler.step_index - steps_before
    assert recent.num_queued == 1
    assert 0 <= recent.seconds <= recent.window_seconds
    assert recent.seconds_since_last_step < 60


def test_recent_busy_time_leaves_out_the_idle_gaps_between_steps(tiny):
    """The recent window's steps span its idle gaps; its busy time does not, so a worker
    that serves now and then still reads as one of short steps (the gateway's stall
    timeout is a multiple of that mean step)."""
    _, model_dir = tiny
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request([5, 6, 7], params, request_id="before")
    drain(engine)
    time.sleep(1.0)  # idle: no step runs
    engine.add_request([8, 9, 10], params, request_id="after")
    drain(engine)
    recent = engine.scheduler.recent_stats()
    assert recent.num_steps >= 8 and recent.seconds >= 1.0
    assert 0 < recent.busy_seconds < recent.seconds - 0.9  # the second of idling is not in it


def test_failed_receive_prefills_here_and_times_only_that_prefill(tiny):
    _, model_dir = tiny
    engine = make_engine(model_dir)
    prompt = list(range(4, 14))
    engine.add_prefilled_request(prompt, 7, SamplingParams(max_tokens=3, ignore_eos=True),
                                 request_id="failed", trace=True)
    engine.step()
    time.sleep(1.0)  # a transfer that takes a while, then fails (long beside a tiny prefill, even on a busy box)
    assert engine.complete_kv_receive("failed", False)
    outputs = drain(engine)["failed"]
    events = events_of(outputs)
    kinds = [type(event) for event in events]
    assert kinds[:3] == [Admitted, KvReceiveFailed, Admitted]
    chunks = [event for event in events if isinstance(event, PrefillChunk)]
    # The prompt and the first token (sampled elsewhere) are computed here, marked as recompute.
    assert sum(c.num_tokens for c in chunks) == len(prompt) + 1
    assert all(c.is_recompute for c in chunks)
    assert kinds.count(FirstDecodeStep) == 1
    timings = outputs[-1].timings
    assert timings.prefill_time is not None and timings.prefill_time < 1.0  # not the failed transfer
    assert timings.queue_time >= 0


def test_timings_come_once_per_request_even_when_held_then_aborted(tiny):
    """A prefill_only request reports its timings when held for the handoff; an abort of
    the held request later (lease expiry, shutdown) must not report them again."""
    _, model_dir = tiny
    engine = make_engine(model_dir)
    engine.add_request(list(range(4, 20)), SamplingParams(max_tokens=5), request_id="held", prefill_only=True)
    held = [output for _ in range(5) for output in engine.step().outputs]
    assert len(held) == 1 and held[0].kv_block_ids and held[0].timings is not None
    assert engine.abort_request("held")
    aborted = drain(engine)["held"]
    assert aborted[-1].finish_reason == "abort" and aborted[-1].timings is None


def test_async_engine_reports_last_outputs_nobody_reads(tiny):
    """on_last_output sees every request's last output, also one whose stream was left
    unread (a cancelled call): the worker's queue and prefill histograms rely on it."""
    import asyncio

    from engine.async_engine import AsyncEngine

    _, model_dir = tiny

    async def scenario() -> list:
        seen = []
        engine = AsyncEngine(make_engine(model_dir), on_last_output=seen.append)
        engine.start()
        try:
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            # "unread" first: the engine admits it no later than "read", so it has been
            # admitted (and has a queue time) when "read" ends and it is aborted.
            await engine.add_request("unread", list(range(5, 13)), SamplingParams(max_tokens=100, ignore_eos=True))
            read = await engine.add_request("read", list(range(4, 12)), params)
            outputs = [output async for output in read]
            await engine.abort("unread")
            for _ in range(100):
                if len(seen) == 2:
                    break
                await asyncio.sleep(0.02)
            assert outputs[-1] in seen
            return seen
        finally:
            await engine.stop()

    seen = asyncio.run(scenario())
    assert sorted((o.request_id, o.finish_reason) for o in seen) == [("read", "length"), ("unread", "abort")]
    assert all(o.timings is not None and o.timings.queue_time >= 0 for o in seen)
