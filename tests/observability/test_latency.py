"""A request's time to its first and second tokens, phase by phase (baton/runtime/latency.py),
over real processes handing the KV over Gloo (ipc: tests/observability/test_tracing.py, on the spans):
every phase of a handed-off request is measured, and the phases of each chain add up to
the time the gateway and the client measured; `baton status` names the largest."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from baton.cli.local import REPO_ROOT, start_deployment
from baton.cli.status import render
from baton.runtime import latency
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine.tokenizer import load_tokenizer
from tests.observability.test_metrics import scrape, value
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

VOCAB_SIZE = 49152  # SmolLM2's tokenizer
FIRST_CHAIN = ("gateway_queue", "prefill_queue", "prefill_compute", "first_token_out")
SECOND_CHAIN = ("gateway_queue", "prefill_queue", "prefill_compute", *latency.HANDOFF_PHASES)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-latency")
    _, path = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float32, vocab_size=VOCAB_SIZE)
    load_tokenizer("smollm2-135m").save_pretrained(directory)
    deployment = start_deployment(
        path, tmp_path_factory.mktemp("logs"),
        worker_args=["--block-size", "4", "--num-kv-blocks", "300", "--kv-transport", "gloo"],
        decode_args=["--verify-kv"],  # the checksums' phase too
        gateway_args=["--max-prefill-queue-tokens", "0"],  # every prompt is handed off
        metrics=True,
    )
    yield deployment
    assert deployment.stop() == {"gateway": 0, "decode": 0, "prefill": 0}, deployment.logs()


def phase_sums(port: int) -> dict[str, float]:
    samples = scrape(port)
    sums = {name: value(samples, "baton_request_phase_seconds_sum", phase=name) for name in latency.PHASE_NAMES}
    sums["ttft"] = value(samples, "baton_time_to_first_token_seconds_sum")
    sums["ttst"] = value(samples, "baton_time_to_second_token_seconds_sum")
    sums["count"] = value(samples, "baton_time_to_second_token_seconds_count")
    for name in latency.PHASE_NAMES:
        sums[f"{name}_count"] = value(samples, "baton_request_phase_seconds_count", phase=name)
    return sums


def test_each_phase_is_measured_and_the_chains_add_up(system):
    gateway_port = system.processes[-1].metrics_port
    with grpc.insecure_channel(system.gateway) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for i in range(3):  # one at a time: a sum's change is one request's
            before = phase_sums(gateway_port)
            prompt = list(range(200 + 40 * i, 230 + 40 * i))
            sent = time.monotonic()
            times = []
            for message in stub.GenerateStream(pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)), timeout=60):
                times += [time.monotonic() - sent] * len(message.token_ids)
            deadline = time.monotonic() + 30
            while (after := phase_sums(gateway_port))["count"] == before["count"]:  # recorded as the stream ends
                assert time.monotonic() < deadline
                time.sleep(0.05)
            request = {name: after[name] - before[name] for name in after}
            assert all(request[f"{name}_count"] == 1 for name in latency.PHASE_NAMES), request
            assert all(request[name] >= 0 for name in latency.PHASE_NAMES), request
            first, second = (sum(request[name] for name in chain) for chain in (FIRST_CHAIN, SECOND_CHAIN))
            # The chains are the gateway's times to the first and second token, taken apart...
            assert first == pytest.approx(request["ttft"], rel=0.05), request
            assert second == pytest.approx(request["ttst"], rel=0.05), request
            # ... and what the client measured is those, plus its own call's way to the gateway and back.
            assert first <= times[0] <= 1.05 * first + 0.01, (times, request)
            assert second <= times[1] <= 1.05 * second + 0.01, (times, request)
    # The first found no blocks set aside (the decode worker had not stepped since it
    # started); the others landed in them: both chains add up either way.
    assert system.stats("decode").num_kv_landed >= 2


def test_status_names_the_largest_phase_of_the_second_token(system):
    """`baton status --json` after test above's requests: every phase over the gateway's
    latest requests, and the one that took most of the time from the first token to the
    second, with what shortens it; the text names it too."""
    shown = json.loads(subprocess.run([sys.executable, "-m", "baton.cli", "status", "--gateway", system.admin,
                                       "--json"], capture_output=True, text=True, timeout=60, check=True,
                                      cwd=REPO_ROOT).stdout)
    latency_status = shown["status"]["latency"]
    assert int(latency_status["num_requests"]) >= 3
    phases = {p["phase"]: p for p in latency_status["phases"]}
    assert set(phases) == set(latency.PHASE_NAMES)
    largest = shown["largest_second_token_phase"]
    assert largest["phase"] == latency_status["largest"] in latency.HANDOFF_PHASES
    assert max(latency.HANDOFF_PHASES, key=lambda name: phases[name]["mean_s"]) == largest["phase"]
    assert largest["advice"] == latency.PHASE_ADVICE[largest["phase"]]
    with system.channel(system.admin) as channel:  # the text, from the same figures
        text = render(system.admin_client(channel).get_deployment_status(timeout=10), [])
    assert f"from the first token to the second: {largest['phase']}" in text


def test_phases_are_the_moments_differences_and_the_window_names_the_largest():
    moments = {name: i * 1_000_000 for i, name in enumerate((
        latency.ARRIVAL, latency.PREFILL_SENT, latency.ADMITTED, latency.FIRST_TOKEN, latency.FIRST_TOKEN_OUT))}
    assert latency.phases(moments) == {"gateway_queue": 0.001, "prefill_queue": 0.001, "prefill_compute": 0.001,
                                       "first_token_out": 0.001}  # no handoff moments: no handoff phases
    window = latency.RecentLatency(size=4)
    assert window.status().num_requests == 0 and window.status().largest == ""
    for i in range(6):  # the first two fall out of the window
        window.add(0.1 + i, 0.2 + i, {"gateway_queue": 9.0, "kv_copy": 0.01 * i, "kv_ready_wait": 0.03})
    status = window.status()
    assert status.num_requests == 4 and status.ttft_p50_s == 4.1 and status.ttst_p90_s == 5.2
    rows = {row.phase: row for row in status.phases}
    assert set(rows) == {"gateway_queue", "kv_copy", "kv_ready_wait"}
    assert rows["kv_copy"].p50_s == 0.04 and rows["kv_copy"].mean_s == pytest.approx(0.035)
    assert status.largest == "kv_copy"  # of the handoff's phases: the gateway's queue comes before the first token


def test_a_handed_off_request_reports_only_its_decode_side_moments():
    """The decode worker's engine admitted a handed-off request to wait for its KV: its moments
    never stand in for the prefill worker's admission and first token. If the pull failed and
    the prompt was prefilled there after all, the token that prefill sampled is the second."""
    received = SimpleNamespace(admitted_at=10.0, first_token_at=None, kv_ready_at=10.5, first_decode_at=10.7)
    assert set(latency.engine_moments(received, handed_off=True)) == {latency.KV_ADMITTED, latency.KV_READY,
                                                                      latency.SECOND_TOKEN}
    failed_pull = SimpleNamespace(admitted_at=10.0, first_token_at=11.0, kv_ready_at=None, first_decode_at=11.2)
    moments = latency.engine_moments(failed_pull, handed_off=True)
    assert set(moments) == {latency.KV_ADMITTED, latency.SECOND_TOKEN}
    assert moments[latency.SECOND_TOKEN] - moments[latency.KV_ADMITTED] == pytest.approx(1e9, abs=1e3)
    colocated = latency.engine_moments(failed_pull)
    assert set(colocated) == {latency.ADMITTED, latency.FIRST_TOKEN, latency.SECOND_TOKEN}
    # A phase that ends before it starts (two hosts' clocks) is left out, not recorded negative.
    assert latency.phases({latency.FIRST_TOKEN: 2_000_000, latency.FIRST_TOKEN_OUT: 1_000_000}) == {}
