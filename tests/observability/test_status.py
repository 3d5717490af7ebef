"""`baton status`: findings from a worker's stats, and the real command against a
deployment whose decode worker is starved of KV blocks."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import grpc
import pytest
import torch

from baton.cli.local import start_deployment
from baton.cli.status import diagnose, diagnose_admission, render
from baton.devtools.otlp_sink import OtlpSink
from baton.wire import stats_convert
from baton.wire.records import AdmissionStatus, DeploymentStatus, WorkerStats, WorkerStatus
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine.statistics import RecentStats
from engine.tokenizer import load_tokenizer
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

VOCAB_SIZE = 49152
DECODE_BLOCKS = 24  # 4-token blocks: a request grows to 18 of them, so few fit at once
NUM_REQUESTS = 16
MAX_TOKENS = 60


def stats(**fields) -> WorkerStats:
    recent = fields.pop("recent", {})
    base = dict(worker_id="w", role="decode", serving=True, max_num_seqs=256, max_num_batched_tokens=2048,
                kv_block_bytes=2**20, num_kv_blocks_total=100)
    window = {name: 0 for name in RecentStats.__dataclass_fields__}
    window.update({"window_seconds": 60, "seconds": 10, "seconds_since_last_step": 0.1, "num_steps": 100,
                   "mean_batch_size": 50, "mean_kv_usage": 0.5, "num_admissions": 100, "num_queued": 100,
                   "mean_queue_seconds": 0.01, **recent})
    return WorkerStats(**{**base, **fields}, recent=RecentStats(**window))


def status(worker_stats: WorkerStats | None = None, *, role: str = "decode", in_rotation: bool = True,
           error: str = "") -> WorkerStatus:
    return WorkerStatus(address="a:1", role=role, reachable=worker_stats is not None, in_rotation=in_rotation,
                        error=error, stats=worker_stats)


def problems(worker_stats: WorkerStats, slo_s: float = 1.0) -> list[str]:
    return [finding.problem for finding in diagnose(status(worker_stats), slo_s)]


def test_diagnose_each_finding():
    assert problems(stats()) == []
    assert problems(stats(recent={"num_steps": 0})) == []  # idle: nothing to say about load
    unreachable = status(role="prefill", in_rotation=False, error="UNAVAILABLE: refused")
    [finding] = diagnose(unreachable, 1.0)
    assert finding.problem == "prefill worker unreachable" and finding.worker == "a:1"
    assert problems(stats(serving=False)) == ["not serving"]
    out = status(stats(), in_rotation=False)
    assert [finding.problem for finding in diagnose(out, 1.0)] == ["serving but not routed to"]

    pressure = stats(recent={"mean_kv_usage": 0.97, "mean_batch_size": 4, "mean_num_waiting": 6,
                             "num_steps_kv_blocked": 80})
    assert problems(pressure) == ["batch held small by memory pressure"]
    # A full cache with nobody waiting or preempted is a well-used cache, not pressure.
    assert problems(stats(recent={"mean_kv_usage": 0.97, "mean_batch_size": 4})) == []

    # Short of blocks in most steps with the cache not full on average: still memory pressure
    # (a whole prompt must fit to be admitted).
    blocked = stats(recent={"mean_batch_size": 4, "mean_num_waiting": 3, "num_steps_kv_blocked": 70})
    [finding] = diagnose(status(blocked), 1.0)
    assert finding.problem == "batch held small by memory pressure"
    assert "70 of 100 steps left requests waiting for KV blocks, with the cache 50% full" in finding.detail
    budget = stats(recent={"mean_batch_size": 4, "mean_num_waiting": 3, "num_steps_kv_blocked": 5})
    [finding] = diagnose(status(budget), 1.0)
    assert finding.problem == "waiting requests not admitted" and "--max-num-batched-tokens 2048" in finding.advice
    assert "short in only 5 of 100 steps" in finding.detail
    # Blocks short in a third of the steps: neither clearly memory nor clearly the budget.
    assert problems(stats(recent={"mean_batch_size": 4, "mean_num_waiting": 3, "num_steps_kv_blocked": 30})) == []
    # On a prefill worker the blocks are held by prompts waiting to be pulled.
    held = stats(role="prefill", num_kv_handoffs_pending=7, recent={"mean_kv_usage": 0.95, "mean_batch_size": 2,
                                                                   "mean_num_waiting": 5})
    held_status = status(held, role="prefill")
    [finding] = diagnose(held_status, 1.0)
    assert "(7 waiting now): add decode workers" in finding.advice

    swapping = stats(recent={"num_admissions": 40, "num_preemptions_recompute": 2, "num_preemptions_swap": 8,
                             "num_swapped_blocks_out": 20})
    [finding] = diagnose(status(swapping), 1.0)
    assert finding.problem == "high preemption rate"
    assert "25% of entries" in finding.detail and "2.5 blocks (2.50 MiB)" in finding.detail
    assert problems(stats(recent={"num_admissions": 40, "num_preemptions_recompute": 4})) == []  # 10%: not high

    assert problems(stats(recent={"mean_queue_seconds": 2.5})) == ["queue time above the SLO"]
    assert problems(stats(recent={"mean_queue_seconds": 2.5}), slo_s=3.0) == []
    # Requests stuck in the queue count too, before any of them is admitted.
    assert problems(stats(oldest_queued_seconds=4.0, recent={"num_queued": 0})) == ["queue time above the SLO"]
    assert problems(stats(num_transfers=9, num_transfer_failures=1, num_leases_expired=2)) == [
        "KV transfers failing", "KV leases expiring"]


@pytest.fixture(scope="module")
def starved(tmp_path_factory):
    """A deployment whose decode worker has too few KV blocks for its load; `baton status`
    runs while the load is on. Traced, so the preemptions show on the decode spans."""
    directory = tmp_path_factory.mktemp("tiny-status")
    _, path = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64, vocab_size=VOCAB_SIZE)
    load_tokenizer("smollm2-135m").save_pretrained(directory)
    sink = OtlpSink().start()
    deployment = start_deployment(
        path,
        tmp_path_factory.mktemp("logs"),
        worker_args=["--dtype", "float64", "--block-size", "4"],
        prefill_args=["--num-kv-blocks", "300"],
        decode_args=["--num-kv-blocks", str(DECODE_BLOCKS), "--preemption-mode", "swap", "--swap-space", "64M"],
        gateway_args=["--max-prefill-queue-tokens", "0"],
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
             "OTEL_BSP_SCHEDULE_DELAY": "200"},
    )
    run = {}
    try:
        with grpc.insecure_channel(deployment.gateway) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            def generate(i: int) -> list[int]:
                request = pb.GenerateRequest(
                    request_id=f"starved-{i}", token_ids=pb.TokenIds(ids=[100 + i] * 12),
                    sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
                return [t for message in stub.GenerateStream(request, timeout=300) for t in message.token_ids]

            with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
                futures = [pool.submit(generate, i) for i in range(NUM_REQUESTS)]
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:  # until the starvation shows
                    decode = deployment.stats("decode")
                    if decode.num_preemptions_swap >= 5 and decode.num_steps >= 60:
                        break
                    time.sleep(0.1)
                command = [sys.executable, "-m", "baton.cli", "status", "--gateway", deployment.admin,
                           "--queue-slo-ms", "1"]
                run["text"] = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
                run["json"] = json.loads(subprocess.run(
                    [*command, "--json"], capture_output=True, text=True, timeout=60, check=True).stdout)
                run["outputs"] = [future.result() for future in futures]
        time.sleep(0.5)
        run["decode_after"] = deployment.stats("decode")
    finally:
        codes = deployment.stop()
        sink.stop()
    assert codes == {"gateway": 0, "decode": 0, "prefill": 0}, deployment.logs()
    run["spans"] = sink.spans()
    return run


def test_status_reports_memory_pressure_and_preemption_on_the_starved_worker(starved):
    text = starved["text"]
    assert "decode-0  decode" in text and "prefill-0  prefill" in text and "SERVING" in text
    assert "decode-0: batch held small by memory pressure" in text, text
    assert "decode-0: high preemption rate" in text, text
    assert "the average swap moved" in text and "MiB) to the CPU and back" in text, text
    assert "decode-0: queue time above the SLO" in text, text
    assert "--kv-cache-memory" in text  # what to change

    findings = starved["json"]["findings"]
    decode = {f["problem"] for f in findings if f["worker"] == "decode-0"}
    assert {"batch held small by memory pressure", "high preemption rate"} <= decode
    prefill = {f["problem"] for f in findings if f["worker"] == "prefill-0"}
    assert not prefill & {"batch held small by memory pressure", "high preemption rate"}
    workers = {w["stats"]["worker_id"]: w for w in starved["json"]["status"]["workers"]}
    recent = workers["decode-0"]["stats"]["recent"]
    assert int(recent["num_steps_kv_blocked"]) * 2 >= int(recent["num_steps"])
    assert int(recent["num_preemptions_swap"]) >= 5

    # Nothing was lost to the starvation: every request got all its tokens, and no block leaked.
    assert [len(tokens) for tokens in starved["outputs"]] == [MAX_TOKENS] * NUM_REQUESTS
    after = starved["decode_after"]
    assert after.num_kv_blocks_used == 0 and after.num_swapped == 0 and after.num_running == 0


def test_decode_spans_carry_preemptions_with_their_kind(starved):
    decode_spans = [s for s in starved["spans"] if s.name == "decode"]
    assert len(decode_spans) == NUM_REQUESTS
    preempted = [e for s in decode_spans for e in s.events if e.name == "preempted"]
    swapped_in = [e for s in decode_spans for e in s.events if e.name == "swapped_in"]
    assert len(preempted) >= 5 and {e.attributes["baton.preemption.kind"] for e in preempted} == {"swap"}
    assert all(e.attributes["baton.preemption.blocks"] >= 1 for e in preempted)
    assert len(swapped_in) == len(preempted)  # every swapped request came back
    assert sum(s.attributes["baton.num_preemptions"] for s in decode_spans) == len(preempted)
    assert starved["decode_after"].num_preemptions_swap == len(preempted)


def test_render_shows_the_prefix_cache():
    cached = stats(prefix_caching=True, prefix_cache_queried_tokens=1000, prefix_cache_hit_tokens=750,
                   num_kv_blocks_cached=40, num_kv_blocks_evictable=30, prefix_cache_received_blocks=80,
                   prefix_cache_reused_blocks=60,
                   recent={"prefix_cache_queried_tokens": 100, "prefix_cache_hit_tokens": 90})
    text = render(DeploymentStatus(model="m", workers=(status(cached), status(stats(worker_id="off")))), [])
    assert ("  prefix      75% of prompt tokens cached since start (750 of 1000), 90% recently; 40 blocks cached, "
            "30 of them unused; 60 of 80 handed-off prompt blocks held already") in text
    assert "  prefix      caching off" in text
    assert "host tier" not in text


def test_render_shows_the_host_tier():
    tiered = stats(prefix_caching=True, num_kv_offload_blocks_total=512, num_kv_offload_blocks_cached=300,
                   prefix_cache_host_hit_tokens=4096, prefix_cache_host_reused_blocks=12,
                   kv_offload_written_blocks=700, kv_offload_reloaded_bytes=256 * 2**20,
                   kv_offload_reload_seconds=0.125, num_kv_offload_evicted=88)
    text = render(DeploymentStatus(model="m", workers=(status(tiered),)), [])
    assert ("  host tier   4096 prompt tokens found there (256.0 MiB copied back in 0.12 s), 12 handed-off blocks; "
            "300 of 512 host blocks cached, 700 written, 88 evicted") in text


def test_render_lists_an_unreachable_worker():
    deployment = DeploymentStatus(model="m", workers=(
        WorkerStatus(address="10.0.0.1:1", role="decode", reachable=False, in_rotation=False,
                     error="UNAVAILABLE: refused"),))
    findings = [f for w in deployment.workers for f in diagnose(w, 1.0)]
    text = render(deployment, findings)
    assert "10.0.0.1:1  decode  10.0.0.1:1  UNREACHABLE" in text
    assert "findings:\n  - 10.0.0.1:1: decode worker unreachable" in text


def admission_status(**fields) -> AdmissionStatus:
    base = dict(max_concurrent_requests=256, max_queue_wait_s=30.0, num_in_flight=3, num_admitted=100,
                num_refused_concurrency=0, num_refused_queue_wait=0, num_refused_deadline=0, num_deadline_misses=0,
                num_met_deadlines=40, forecast_known=True, forecast_queue_wait_s=0.25, mean_forecast_ttft_s=0.3,
                mean_observed_ttft_s=0.35)
    return AdmissionStatus(**{**base, **fields})


def test_render_shows_admission_and_diagnoses_its_refusals_and_misses():
    healthy = admission_status()
    text = render(DeploymentStatus("m", (status(stats()),), healthy), diagnose_admission(healthy))
    assert "gateway admission  3 in flight (limit 256), 100 admitted since start" in text
    assert "  refused     none" in text and "  deadlines   40 met, 0 missed after admission" in text
    assert ("  forecast    a first token now in 0.25 s (limit 30 s); recent first tokens 0.30 s forecast, "
            "0.35 s observed (mean)") in text
    assert "findings: none" in text
    troubled = admission_status(num_refused_concurrency=1, num_refused_queue_wait=2, num_refused_deadline=3,
                                num_deadline_misses=4)
    problems_ = [f.problem for f in diagnose_admission(troubled)]
    assert problems_ == ["deadlines missed after admission", "requests refused"]
    text = render(DeploymentStatus("m", (), troubled), diagnose_admission(troubled))
    assert "  refused     1 concurrency, 2 queue wait, 3 deadline" in text
    assert "6 of 106 requests refused since start" in text
    unknown = admission_status(forecast_known=False, max_concurrent_requests=0)
    text = render(DeploymentStatus("m", (), unknown), [])
    assert "(limit unknown)" in text and "forecast    none yet" in text
    # The wire carries it, and --json shows it.
    deployment = DeploymentStatus("m", (status(stats()),), troubled)
    assert stats_convert.deployment_status_from_pb(stats_convert.deployment_status_to_pb(deployment)) == deployment
    assert stats_convert.deployment_status_to_json(deployment)["admission"]["num_refused_deadline"] == "3"


def test_render_shows_speculation_on_a_worker_that_speculates():
    speculating = stats(worker_id="spec", num_speculative_tokens=3, spec_num_checks=100, spec_num_proposed=250,
                        spec_num_accepted=150, spec_num_emitted=250, spec_check_cost_steps=125.0,
                        spec_proposed_by_position=(100, 90, 60), spec_accepted_by_position=(80, 45, 25))
    fresh = stats(worker_id="fresh", num_speculative_tokens=4)
    workers = (status(speculating), status(fresh), status(stats(worker_id="off")))
    text = render(DeploymentStatus(model="m", workers=workers), [])
    assert ("  speculation up to 3 proposed tokens a row and step: 60% accepted (150 of 250; by position 80% 50% "
            "42%), 250 tokens in 100 checks, 2.00x plain decoding's speed") in text
    assert "  speculation up to 4 proposed tokens a row and step; none checked yet" in text
    assert text.count("speculation") == 2  # the worker that does not speculate shows no line
    # The per-position counts cross the wire as repeated fields and come back as tuples.
    assert stats_convert.worker_stats_from_pb(stats_convert.worker_stats_to_pb(speculating)) == speculating
    assert problems(speculating) == []
