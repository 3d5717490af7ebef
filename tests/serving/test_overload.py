"""Overload end to end over real processes: a burst within the gateway's concurrency
queues, however long its prompts; one far over it gets some requests served and the rest
refused at once with RESOURCE_EXHAUSTED and a RetryInfo, nothing leaks, and the system
serves normally afterwards; a worker's own bound refuses a direct call the same way; and
benchmarks/overload.py's phases, deadlines and goodput included, at tiny scale."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import NamedTuple

import grpc
import pytest
import torch

from baton.cli.local import start_deployment
from baton.runtime.clients import DecodeWorkerClient
from baton.wire.records import DecodeRequest, WorkRequest
from baton.wire.status import error_details_from_trailers
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from tests.serving.test_serving import VOCAB_SIZE, greedy_request
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

MAX_NUM_SEQS = 4  # the decode worker's; the gateway admits this many requests at once
DECODE_MAX_QUEUED = 2  # the decode worker's own bound: 6 Decode calls at once
PREFILL_BUDGET = 64  # prompt tokens per prefill step: a burst's prompts take several


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-overload")
    _, path = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float32, vocab_size=VOCAB_SIZE)
    load_tokenizer("smollm2-135m").save_pretrained(directory)
    deployment = start_deployment(
        path,
        tmp_path_factory.mktemp("logs"),
        worker_args=["--block-size", "4", "--num-kv-blocks", "400"],
        prefill_args=["--max-num-batched-tokens", str(PREFILL_BUDGET)],
        decode_args=["--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(DECODE_MAX_QUEUED)],
        # The gateway's limits are derived from these workers' stats.
        gateway_args=["--max-prefill-queue-tokens", "0"],
    )
    yield deployment
    codes = deployment.stop()
    assert codes == {"gateway": 0, "decode": 0, "prefill": 0}, deployment.logs()


class Generated(NamedTuple):
    status: str  # "ok" or the gRPC status name
    seconds: float  # to the outcome
    message: str = ""  # a failure's
    retry_after_s: float | None = None  # a failure's RetryInfo


def generate(stub, index: int, prompt_len: int = 40) -> Generated:
    """One request of a burst, 150 tokens (its 120 s deadline never near)."""
    sent = time.perf_counter()
    try:
        tokens = [t for m in stub.GenerateStream(greedy_request([100 + index] * prompt_len, 150), timeout=120)
                  for t in m.token_ids]
    except grpc.RpcError as error:
        details = error_details_from_trailers(error.trailing_metadata())
        return Generated(error.code().name, time.perf_counter() - sent, error.details(), details.retry_after_s)
    assert len(tokens) == 150
    return Generated("ok", time.perf_counter() - sent)


def test_a_burst_within_the_concurrency_bound_queues_however_long_its_prompts(system, stub):
    """As many requests at once as the gateway admits, with prompts of 3 prefill steps
    each (the old bound, half a step of queued prompt tokens, refused all but the first):
    every one is served."""
    system.wait_idle()
    with concurrent.futures.ThreadPoolExecutor(MAX_NUM_SEQS) as pool:
        outcomes = list(pool.map(lambda i: generate(stub, i, 3 * PREFILL_BUDGET), range(MAX_NUM_SEQS)))
    assert [o.status for o in outcomes] == ["ok"] * MAX_NUM_SEQS, outcomes
    system.wait_idle()


def test_a_burst_over_the_limits_is_served_in_part_and_refused_at_once(system, stub):
    system.wait_idle()
    num_requests = 40
    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        outcomes = list(pool.map(lambda i: generate(stub, i), range(num_requests)))
    served = [o for o in outcomes if o.status == "ok"]
    refused = [o for o in outcomes if o.status == "RESOURCE_EXHAUSTED"]
    assert len(served) + len(refused) == num_requests, outcomes
    # The concurrency bound (MAX_NUM_SEQS in flight) refuses the rest: a request that
    # arrives once one of the first has finished gets in too (a slow machine: more).
    assert len(served) >= MAX_NUM_SEQS and refused, (len(served), len(refused))
    for outcome in refused:
        assert outcome.seconds < 1.0  # refused at once, not queued (the benchmark measures the 50 ms)
        assert "in flight" in outcome.message, outcome.message
        assert outcome.retry_after_s is not None and outcome.retry_after_s > 0
    # Nothing held anywhere afterwards: no blocks, no queued or pending handoffs, no lease.
    stats = system.wait_idle()
    assert stats["prefill-0"].num_leases_expired == 0
    assert stats["decode-0"].num_transfer_failures == 0
    # And it serves as before.
    assert generate(stub, 999)[0] == "ok"
    system.wait_idle()


def test_a_decode_worker_refuses_calls_beyond_its_own_queue(system):
    """Called directly (as a second gateway would), the decode worker takes max_num_seqs +
    max_queued_requests calls and refuses the next with RESOURCE_EXHAUSTED and a RetryInfo;
    but never a request moved off a lost worker (attempt > 0), which it queues past its bound."""
    system.wait_idle()
    params = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)

    async def consume(client: DecodeWorkerClient, request_id: str, attempt: int = 0) -> None:
        work = WorkRequest(request_id, [5, 6, 7, 8], params, attempt=attempt)
        async for _ in client.decode(DecodeRequest(work), timeout=60):
            pass

    async def wait_for(client: DecodeWorkerClient, num_running: int, num_waiting: int) -> None:
        deadline = time.monotonic() + 30
        while True:
            stats = await client.get_stats(timeout=10)
            if (stats.num_running, stats.num_waiting) == (num_running, num_waiting):
                return
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.01)

    async def scenario() -> grpc.aio.AioRpcError:
        client = DecodeWorkerClient(system.worker("decode").address)
        calls = [asyncio.create_task(consume(client, f"direct-{i}"))
                 for i in range(MAX_NUM_SEQS + DECODE_MAX_QUEUED)]
        try:
            await wait_for(client, MAX_NUM_SEQS, DECODE_MAX_QUEUED)  # a full batch and a full queue
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await consume(client, "one-too-many")
            calls.append(asyncio.create_task(consume(client, "moved~1", attempt=1)))
            await wait_for(client, MAX_NUM_SEQS, DECODE_MAX_QUEUED + 1)  # queued past the bound
            assert not calls[-1].done()
            return refused.value
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await client.close()

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert "sequences in flight" in error.details()
    assert error_details_from_trailers(error.trailing_metadata()).retry_after_s > 0
    system.wait_idle()


def test_the_overload_benchmark_at_tiny_scale(system):
    """benchmarks/overload.py's phases against this deployment, a few seconds each: every
    request is served or refused with a hint, or (with a deadline) refused or cut off by
    it, none fails otherwise; the deadline phases have goodput, refuse at once and admit
    no request that then misses its deadline by more than the target's margin; the report
    holds every figure and check. How the figures compare with their targets means
    nothing at this scale."""
    from benchmarks import overload

    deadline = 6.0
    args = overload.parse_args(["--seconds", "2", "--capacity-seconds", "1", "--burst", "12",
                                "--unloaded-requests", "3", "--deadline", str(deadline),
                                "--burst-prompt-tokens", "16", "--burst-output-tokens", "48",
                                "--mixed-deadlines", "10,30,none"])
    mixed, bursting = overload.workloads(args, VOCAB_SIZE, max_context=512)
    assert {(r.num_prompt_tokens, r.max_tokens) for r in bursting} == {(16, 48)}
    system.wait_idle()
    report = asyncio.run(overload.measure(args, system, mixed, bursting))
    settled = {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}  # nothing else: no INTERNAL, no UNAVAILABLE

    cap = report["capacity"]
    assert cap["mixed"]["requests_per_s"] > 0 and cap["mixed"]["concurrency"] == MAX_NUM_SEQS
    assert cap["burst"]["requests_per_s"] > 0 and cap["burst"]["deadline_s"] == deadline
    assert cap["burst"]["output_tokens_per_s"] == pytest.approx(48 * cap["burst"]["requests_per_s"])

    over = report["overload"]
    assert over["max_queue_wait_s"] == pytest.approx(report["unloaded"]["ttft_p99_ms"] / 1e3)
    assert set(over["statuses"]) <= settled, over["statuses"]
    assert over["statuses"].get("OK", 0) > 0 and over["ttft_p99_ratio"] > 0
    assert over["goodput_requests_per_s"] > 0 and over["goodput_output_tokens_per_s"] > 0
    assert over["gateway_exit_code"] == 0

    burst = report["burst"]
    assert set(burst["statuses"]) <= {"OK", "DEADLINE_EXCEEDED"}, burst["statuses"]  # served, or out of time
    assert burst["statuses"].get("OK", 0) > 0 and burst["num_refusals"] > 0  # 12 at once over a limit of 4
    assert burst["goodput_requests_per_s"] > 0
    assert burst["goodput_output_tokens_per_s"] == pytest.approx(48 * burst["goodput_requests_per_s"])
    assert 0 < burst["window_s"] <= deadline + 1
    assert 0 < burst["slowest_refusal_ms"] < 1000  # at once, not queued (the benchmark's target: 1 s)
    assert burst["worst_miss_share"] <= overload.MISS_TARGET_SHARE and burst["num_unanswered"] == 0, burst
    # The gateway counted each refusal the clients saw, by its reason.
    refused = sum(burst["admission"][f"num_refused_{reason}"] for reason in ("concurrency", "queue_wait", "deadline"))
    assert refused == burst["num_refusals"], burst["admission"]
    assert report["floor"]["num_calls"] == 12 and report["floor"]["refusal_p99_ms"] > 0
    assert burst["first_refusal_p99_ms"] > 0 and burst["first_wave_gateway_cpu_ms_per_call"] >= 0

    classes = report["mixed"]["classes"]
    assert set(classes) == {"10 s", "30 s", "none"}
    for name, figures in classes.items():
        assert set(figures["statuses"]) <= settled, (name, figures["statuses"])
        assert figures["completions"] > 0 and figures["goodput_requests_per_s"] > 0, (name, figures)
        assert figures["slowest_refusal_ms"] < 1000, (name, figures)
        assert figures["worst_miss_share"] <= overload.MISS_TARGET_SHARE, (name, figures)
        assert figures["num_unanswered"] == 0, (name, figures)
    assert set(classes["none"]["refused_by_status"]) <= {"RESOURCE_EXHAUSTED"}  # no deadline to refuse by

    assert set(report["rss"]) == {"gateway", "prefill", "decode", "overload gateway"}
    assert all(figures["start_mb"] > 0 and not figures["exited"] for figures in report["rss"].values())
    checks = overload.checks(report)
    assert len(checks) == 14 and len({c["name"] for c in checks}) == 14
    overload.print_report({**report, "checks": checks})
    system.wait_idle()


def test_the_cold_burst_benchmark_sorts_each_call_as_the_client_saw_it():
    """benchmarks/cold_burst.py's figures: completed in time, admitted then ended by the
    deadline (or shed: a token came first), refused before any token; goodput over the
    burst's span against the warm capacity; and the targets it checks."""
    from benchmarks.cold_burst import checks, figures, parse_args
    from benchmarks.load import Outcome

    outcomes = [Outcome("OK", 0.0, 20.0, 0.5, num_output_tokens=400, deadline_s=30.0),
                Outcome("OK", 10.0, 45.0, 1.0, num_output_tokens=400, deadline_s=30.0),  # past its deadline
                Outcome("DEADLINE_EXCEEDED", 0.0, 30.0, 0.4, num_output_tokens=120, deadline_s=30.0),
                Outcome("RESOURCE_EXHAUSTED", 0.0, 0.3, refusal_seconds=(0.3,), deadline_s=30.0, is_refused=True)]
    shown = figures(outcomes, 30.0, capacity_per_s=0.05)
    assert (shown["completed_in_time"], shown["admitted_then_late"], shown["refused"]) == (1, 2, 1)
    assert shown["late_share"] == pytest.approx(2 / 3) and shown["slowest_refusal_s"] == pytest.approx(0.3)
    assert shown["goodput_per_s"] == pytest.approx(1 / 45.0)
    rows = checks({"cases": {"one-thread": shown}})
    assert [row["ok"] for row in rows] == [False, False, True]
    assert parse_args(["--quick"]).cases == ("one-thread",) and parse_args([]).burst == 1500
    # Where the client shares the cores, a refusal is held to 2x a do-nothing server's p99 (if over 1 s).
    assert figures(outcomes, 30.0, 0.05, pings=[0.01] * 99 + [0.8], own_core=False)["refusal_target_s"] == 1.0
    shared = figures(outcomes, 30.0, 0.05, pings=[0.9] * 100, own_core=False)
    assert shared["refusal_target_s"] == pytest.approx(1.8) and shared["do_nothing_p99_s"] == pytest.approx(0.9)


def test_a_request_shed_before_its_first_token_was_admitted_not_refused():
    """The gateway sheds with DEADLINE_EXCEEDED "shed: ..." before the deadline, a token
    come or not: the client counts it admitted (then late), not refused nor unanswered."""
    from benchmarks.load import Attempt

    shed = Attempt("DEADLINE_EXCEEDED", 12.0, None, 0, None, 30.0, "shed: the deployment fell behind its forecast")
    assert shed.is_shed and not shed.is_refusal and not shed.is_unanswered
    refused = Attempt("DEADLINE_EXCEEDED", 0.01, None, 0, None, 30.0, "refused: its deadline cannot be met")
    assert refused.is_refusal and not refused.is_shed
