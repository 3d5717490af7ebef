"""Admission control on records: the bounded queue (baton/runtime/admission.py), the
gateway's limits derived from its workers (gateway/admission.py), the workers' own."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from baton.runtime.admission import (
    DEFAULT_RETRY_S,
    DRAIN_WINDOW,
    MAX_RETRY_S,
    MIN_RETRY_S,
    AdmissionLimits,
    AdmissionQueue,
    Overloaded,
)
from baton.runtime.settings import DecodeWorkerSettings, GatewaySettings, PrefillWorkerSettings
from baton.runtime.worker import worker_limits
from baton.wire.records import WorkerStats
from engine.sampling_params import SamplingParams
from gateway.admission import UNKNOWN, GatewayAdmission, GatewayLimits
from gateway.errors import RequestError
from gateway.workers import RoutingPolicy, WorkerPool


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_requests_beyond_the_limit_are_refused_and_a_release_makes_room():
    queue = AdmissionQueue(AdmissionLimits(max_requests=2, max_queued_tokens=1000))
    queue.admit("a", 10)
    queue.admit("b", 10)
    with pytest.raises(Overloaded, match="2 sequences in flight"):
        queue.admit("c", 10)
    assert "c" not in queue and queue.num_requests == 2 and queue.num_queued_tokens == 20
    assert queue.num_refused == 1
    queue.release("a")
    queue.release("a")  # idempotent
    queue.admit("c", 10)
    assert queue.num_requests == 2 and queue.num_queued_tokens == 20


def test_queued_tokens_are_bounded_until_the_first_token():
    queue = AdmissionQueue(AdmissionLimits(max_requests=10, max_queued_tokens=100))
    queue.admit("a", 60)
    queue.admit("b", 40)  # exactly at the bound
    with pytest.raises(Overloaded, match="100 prompt tokens queued"):
        queue.admit("c", 1)
    assert "c" not in queue  # refused on tokens: not held either
    queue.started("a")  # a's first token: its prompt no longer waits
    assert queue.num_queued_tokens == 40 and queue.num_requests == 2
    queue.admit("c", 60)
    queue.release("b")  # ended before its first token: its tokens leave too
    assert queue.num_queued_tokens == 60 and queue.num_requests == 2


def test_a_prompt_longer_than_the_bound_runs_alone():
    queue = AdmissionQueue(AdmissionLimits(max_requests=10, max_queued_tokens=100))
    queue.admit("long", 500)  # nothing else queued: admitted, or it could never run
    with pytest.raises(Overloaded):
        queue.admit("short", 1)
    queue.started("long")
    queue.admit("short", 1)


def test_tokens_queued_after_admission_can_refuse_and_release():
    """The gateway admits by count before tokenizing, then queues the prompt's tokens."""
    queue = AdmissionQueue(AdmissionLimits(max_requests=10, max_queued_tokens=100))
    queue.admit("a")
    queue.queue_tokens("a", 90)
    queue.admit("b")
    with pytest.raises(Overloaded):
        queue.queue_tokens("b", 20)
    assert "b" not in queue and queue.num_requests == 1 and queue.num_queued_tokens == 90


def test_a_duplicate_request_id_is_a_value_error():
    queue = AdmissionQueue(AdmissionLimits(max_requests=10, max_queued_tokens=100))
    queue.admit("a", 1)
    with pytest.raises(ValueError, match="already running"):
        queue.admit("a", 1)
    assert queue.num_requests == 1 and queue.num_queued_tokens == 1


def test_retry_hint_follows_the_drain_rate_within_bounds():
    clock = Clock()
    queue = AdmissionQueue(AdmissionLimits(max_requests=4, max_queued_tokens=10**6), clock)
    for i in range(4):
        queue.admit(f"r{i}")
    with pytest.raises(Overloaded) as refused:
        queue.admit("x")
    assert refused.value.retry_after_s == DEFAULT_RETRY_S  # nothing has left yet
    # Two requests leave per second: one over the limit waits about half a second.
    for i in range(4):
        clock.now += 0.5
        queue.release(f"r{i}")
        queue.admit(f"s{i}")
    with pytest.raises(Overloaded) as refused:
        queue.admit("x")
    assert refused.value.retry_after_s == pytest.approx(0.5, rel=0.01)
    # A queue that stopped draining reads as slow, up to the cap.
    clock.now += 1000
    with pytest.raises(Overloaded) as refused:
        queue.admit("x")
    assert refused.value.retry_after_s == MAX_RETRY_S
    # A fast drain (once it fills the window) is floored.
    for i in range(DRAIN_WINDOW + 4):
        clock.now += 1e-4
        queue.release(f"s{i}" if i < 4 else f"t{i - 4}")
        queue.admit(f"t{i}")
    with pytest.raises(Overloaded) as refused:
        queue.admit("x")
    assert refused.value.retry_after_s == MIN_RETRY_S


def test_a_prompt_longer_than_the_bound_waits_only_for_the_queue_to_drain():
    """It gets in once nothing is queued, so its hint counts the queued tokens, not how
    far its own length goes past the bound."""
    clock = Clock()
    queue = AdmissionQueue(AdmissionLimits(max_requests=100, max_queued_tokens=256), clock)
    for i in range(3):  # 100 tokens a second leave the queue
        queue.admit(f"r{i}", 100)
        clock.now += 1.0
        queue.started(f"r{i}")
    queue.admit("queued", 100)
    with pytest.raises(Overloaded) as refused:
        queue.admit("long", 500)  # 344 tokens past the bound; 100 queued ahead of it
    assert refused.value.retry_after_s == pytest.approx(1.0, rel=0.01)
    with pytest.raises(Overloaded) as refused:
        queue.admit("short", 200)  # 44 past the bound: that much must drain first
    assert refused.value.retry_after_s == pytest.approx(0.44, rel=0.01)
    queue.started("queued")
    queue.admit("long", 500)  # alone: admitted


def test_limits_must_be_positive():
    with pytest.raises(ValueError):
        AdmissionLimits(0, 10)
    with pytest.raises(ValueError):
        AdmissionLimits(10, 0)


# ----------------------------------------------------------------- gateway
@pytest.fixture(autouse=True)
def thread_event_loop():
    """The pool's grpc.aio channels want this thread's event loop, which an earlier test's
    asyncio.run leaves unset: a fresh one per test."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    asyncio.set_event_loop(None)
    loop.close()


def _pool(prefill_budgets: list[int], decode_seqs: list[int], decode_budget: int = 2048) -> WorkerPool:
    pool = WorkerPool([f"127.0.0.1:{1 + i}" for i in range(len(prefill_budgets))],
                      [f"127.0.0.1:{100 + i}" for i in range(len(decode_seqs))], RoutingPolicy(0, 0))
    for worker, budget in zip(pool.prefill, prefill_budgets):
        worker.stats = WorkerStats(worker_id="p", role="prefill", serving=True, max_num_batched_tokens=budget,
                                   max_num_seqs=256)
    for worker, seqs in zip(pool.decode, decode_seqs):
        worker.stats = WorkerStats(worker_id="d", role="decode", serving=True, max_num_batched_tokens=decode_budget,
                                   max_num_seqs=seqs)
    return pool


def test_gateway_limits_derive_from_the_workers():
    pool = _pool([512, 256], [64, 32])
    assert GatewayLimits().derive(pool.decode) == AdmissionLimits(64 + 32, UNKNOWN.max_queued_tokens)
    # Configured limits win; the token bound is off unless configured.
    assert GatewayLimits(7, 900).derive(pool.decode) == AdmissionLimits(7, 900)
    # No worker has reported yet: no limit (the dispatcher answers UNAVAILABLE).
    pool = WorkerPool([], ["127.0.0.1:9"], RoutingPolicy(0, 0))
    assert GatewayLimits().derive(pool.decode) == UNKNOWN
    with pytest.raises(ValueError):
        GatewayLimits(-1, 0)
    with pytest.raises(ValueError):
        GatewayLimits(max_queue_wait_s=0)
    settings = GatewaySettings(decode_workers=("127.0.0.1:2",), max_concurrent_requests=5, max_queued_tokens=6,
                               max_queue_wait_s=2.5)
    assert GatewayLimits.from_settings(settings) == GatewayLimits(5, 6, 2.5)
    assert GatewayLimits.from_settings(GatewaySettings(decode_workers=("127.0.0.1:2",))).max_queue_wait_s == 60.0


def test_gateway_refuses_with_resource_exhausted_and_a_retry_hint():
    admission = GatewayAdmission(_pool([64], [2]), GatewayLimits(max_queued_tokens=64))
    admission.admit("a")
    admission.queue_tokens("a", 100)  # alone: longer than the bound, it still gets in
    admission.admit("b")
    with pytest.raises(RequestError) as refused:
        admission.admit("c")  # 2 requests: the decode worker's max_num_seqs
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.reason == "concurrency"
    assert refused.value.error_details.retry_after_s == DEFAULT_RETRY_S
    assert "retry in" in refused.value.details
    with pytest.raises(RequestError) as refused:
        admission.queue_tokens("b", 100)  # over the configured token bound, with some already queued
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert admission.queue.num_requests == 1
    admission.started("a")
    admission.release("a")
    assert admission.queue.num_requests == 0 and admission.queue.num_queued_tokens == 0


def test_n_choices_count_as_n_sequences_in_the_bound_and_the_forecast():
    """A request of n choices runs n sequences: it takes n places of the decode workers'
    max_num_seqs, and the forecast's decode batch grows by n."""
    admission = GatewayAdmission(_pool([64], [8]))
    admission.admit("a", num_seqs=5)
    admission.queue_tokens("a", 10, SamplingParams(n=5), num_seqs=5)
    assert admission.queue.num_seqs == 5 and admission.forecast.num_seqs == 5
    with pytest.raises(RequestError) as refused:
        admission.admit("b", num_seqs=4)  # 9 sequences: one over
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.reason == "concurrency"
    admission.check_room(3)  # a batch of three fits, and holds nothing
    assert admission.queue.num_seqs == 5
    with pytest.raises(RequestError) as never:
        admission.check_room(9)  # more than the deployment ever runs at once: no retry helps
    assert never.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert never.value.error_details.field_violations[0][0] == "sampling.n"
    admission.admit("b", num_seqs=3)
    admission.release("a")
    admission.release("b")
    assert admission.queue.num_seqs == 0 and admission.forecast.num_seqs == 0


# ----------------------------------------------------------------- workers
def test_worker_limits_default_to_the_batch_and_the_cache():
    settings = DecodeWorkerSettings(max_num_seqs=8, block_size=4)
    assert worker_limits(settings, num_kv_blocks=100, max_model_len=512) == AdmissionLimits(16, 4 * 400)
    assert worker_limits(settings, num_kv_blocks=10, max_model_len=512) == AdmissionLimits(16, 512)
    settings = PrefillWorkerSettings(max_num_seqs=8, max_queued_requests=3, max_queued_tokens=50)
    assert worker_limits(settings, num_kv_blocks=100, max_model_len=512) == AdmissionLimits(11, 50)
    with pytest.raises(ValueError):
        DecodeWorkerSettings(max_queued_requests=-1)
    with pytest.raises(ValueError):
        GatewaySettings(decode_workers=("127.0.0.1:2",), max_queued_tokens=-1)


def test_exempt_work_is_admitted_past_the_limits_and_counts_toward_them():
    """A request moved off a lost worker (WorkRequest.attempt > 0) is never refused."""
    queue = AdmissionQueue(AdmissionLimits(max_requests=1, max_queued_tokens=10))
    queue.admit("a", 10)
    queue.admit("moved", 50, is_exempt=True)
    assert queue.num_requests == 2 and queue.num_queued_tokens == 60 and queue.num_refused == 0
    with pytest.raises(Overloaded):
        queue.admit("new", 1)
