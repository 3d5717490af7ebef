"""Prometheus metrics of every process after a known workload, scraped over HTTP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import urllib.request

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton.cli.local import start_deployment
from baton.runtime.metrics import GatewayMetrics, WorkerMetrics
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine import LLM, SamplingParams
from engine.tokenizer import load_tokenizer
from gateway.service import GenerationService
from gateway.workers import RoutingPolicy, WorkerPool
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

VOCAB_SIZE = 49152  # SmolLM2's tokenizer


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-metrics")
    _, path = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64, vocab_size=VOCAB_SIZE)
    load_tokenizer("smollm2-135m").save_pretrained(directory)
    deployment = start_deployment(
        path,
        tmp_path_factory.mktemp("logs"),
        worker_args=["--dtype", "float64", "--block-size", "4", "--num-kv-blocks", "300"],
        gateway_args=["--max-prefill-queue-tokens", "0"],  # every prompt is handed off
        metrics=True,
    )
    yield deployment
    assert deployment.stop() == {"gateway": 0, "decode": 0, "prefill": 0}, deployment.logs()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def total(samples, name: str) -> float:
    """The sum of a metric's series, whatever their labels (0 when it has none yet)."""
    return sum(v for (n, _), v in samples.items() if n == name)


def request(prompt: list[int], max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling),
    )


def test_counters_match_the_workload_and_kv_returns_to_zero(system):
    prompts = [list(range(100 + i, 100 + i + 10 + 7 * i)) for i in range(6)]
    with grpc.insecure_channel(system.gateway) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            streams = list(pool.map(lambda p: list(stub.GenerateStream(request(p, 5), timeout=60)), prompts))
        received = sum(len(m.token_ids) for messages in streams for m in messages)
        # One request stopped by a stop token id: its second generated token.
        probe = list(stub.GenerateStream(request(list(range(300, 320)), 6), timeout=60))
        probe_tokens = [t for m in probe for t in m.token_ids]
        stopped = list(stub.GenerateStream(request(list(range(300, 320)), 6, stop_token_ids=[probe_tokens[1]]),
                                           timeout=60))
        # One cancelled mid-stream.
        # (No deadline: admission would refuse 4000 tokens that cannot finish within one.)
        call = stub.GenerateStream(request(list(range(400, 430)), 4000))
        cancelled = 0
        for message in call:
            cancelled += len(message.token_ids)
            if cancelled >= 3:
                break
        call.cancel()
    assert received == 6 * 5
    stopped_tokens = sum(len(m.token_ids) for m in stopped)
    assert stopped_tokens == 2 and stopped[-1].finish_reason == pb.FINISH_REASON_STOP

    deadline = time.monotonic() + 30
    while True:  # the workers see the cancel a moment after the client does
        workers = {role: scrape(system.worker(role).metrics_port) for role in ("prefill", "decode")}
        # The histograms are read before the engine snapshot in a scrape: wait for the
        # cancelled request's count as well as for the idle engine.
        idle = all(value(s, "baton_kv_cache_blocks_used") == 0 and value(s, "baton_num_requests_running") == 0
                   and value(s, "baton_request_queue_time_seconds_count") == 9 for s in workers.values())
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for role, samples in workers.items():
        assert value(samples, "baton_kv_cache_blocks_used") == 0, role
        assert value(samples, "baton_kv_cache_blocks_total") == 300, role
        assert value(samples, "baton_num_requests_waiting") == 0, role
        assert value(samples, "baton_preemptions_total", kind="recompute") == 0, role
        assert total(samples, "baton_kv_transfer_failures_total") == 0, role
        assert total(samples, "baton_kv_channel_refusals_total") == 0, role
    # The stopped request repeated the probe's prompt: wherever it was prefilled, it was found cached.
    hits = sum(value(workers[r], "baton_prefix_cache_hits_total") for r in ("prefill", "decode"))
    queries = sum(value(workers[r], "baton_prefix_cache_queries_total") for r in ("prefill", "decode"))
    assert 0 < hits < queries
    # Every request but the cancelled one may have been handed off; both sides counted the same bytes,
    # all over ipc (one host).
    sent, got = (value(workers[r], "baton_kv_transferred_bytes_total", transport="ipc") for r in ("prefill", "decode"))
    assert sent == got > 0 and total(workers["decode"], "baton_kv_transferred_bytes_total") == got
    num_transfers = system.stats("decode").num_transfers
    assert value(workers["decode"], "baton_kv_transfer_seconds_count", transport="ipc") == num_transfers
    # Queue and prefill time: every request was prefilled on the prefill worker, none on the
    # decode worker. The cancelled request counts on both: it was admitted on each.
    assert value(workers["prefill"], "baton_request_queue_time_seconds_count") == 9
    assert value(workers["prefill"], "baton_request_prefill_time_seconds_count") == 9
    assert value(workers["prefill"], "baton_request_prefill_time_seconds_sum") > 0
    assert value(workers["decode"], "baton_request_queue_time_seconds_count") == 9
    assert value(workers["decode"], "baton_request_prefill_time_seconds_count") == 0

    gateway = scrape(system.processes[-1].metrics_port)
    num_prompt = sum(map(len, prompts)) + 20 + 20 + 30
    assert value(gateway, "baton_prompt_tokens_total") == num_prompt
    exact = received + len(probe_tokens) + stopped_tokens
    # The gateway may have streamed a few more tokens of the cancelled request than we read.
    cancelled_at_gateway = value(gateway, "baton_generation_tokens_total") - exact
    assert cancelled_at_gateway >= cancelled
    assert value(gateway, "baton_requests_finished_total", finish_reason="length") == 7
    assert value(gateway, "baton_requests_finished_total", finish_reason="stop") == 1
    assert value(gateway, "baton_requests_finished_total", finish_reason="abort") == 1
    assert value(gateway, "baton_requests_finished_total", finish_reason="error") == 0
    assert value(gateway, "baton_e2e_request_latency_seconds_count") == 9
    assert value(gateway, "baton_time_to_first_token_seconds_count") == 9
    assert value(gateway, "baton_time_per_output_token_seconds_count") == 9  # each got 2+ tokens
    # Inter-token gaps: tokens - 1 per request.
    assert value(gateway, "baton_inter_token_latency_seconds_count") == (
        6 * 4 + (len(probe_tokens) - 1) + (stopped_tokens - 1) + (cancelled_at_gateway - 1)
    )
    # Nothing in flight once every stream has ended.
    assert value(gateway, "baton_requests_in_flight", front="grpc") == 0
    assert value(gateway, "baton_requests_in_flight", front="http") == 0
    # One model label, vLLM's name for it, on every process's series.
    models = {dict(labels).get("model_name") for samples in (gateway, *workers.values())
              for (name, labels) in samples if name.startswith("baton_")}
    assert len(models) == 1 and None not in models, models
    # The standard process and GC collectors, and what each process runs.
    for role, samples in (("gateway", gateway), *workers.items()):
        assert value(samples, "process_cpu_seconds_total") > 0, role
        assert value(samples, "process_resident_memory_bytes") > 0, role
        assert total(samples, "python_gc_collections_total") > 0, role
        build = [dict(labels) for (name, labels) in samples if name == "baton_build_info"]
        assert len(build) == 1 and build[0]["role"] == role and build[0]["version"], (role, build)
        assert ("torch_version" in build[0]) == (role != "gateway"), build  # the gateway loads no torch


def test_the_in_flight_gauge_reads_admissions_count_by_front_end():
    asyncio.run(in_flight_gauge())


async def in_flight_gauge() -> None:
    """On an event loop: the pool's gRPC channels are asyncio's."""
    pool = WorkerPool([], ["127.0.0.1:9"], RoutingPolicy(0, 0))
    service = GenerationService(pool, GatewayMetrics("m"))  # no worker polled yet: admission stands aside

    def in_flight(front: str) -> float:
        return service.metrics.registry.get_sample_value("baton_requests_in_flight",
                                                         {"model_name": "m", "front": front})

    service.admission.admit("a", "grpc")
    service.admission.admit("b", "http")
    service.admission.admit("c", "http")
    assert (in_flight("grpc"), in_flight("http")) == (1, 2)
    service.admission.release("b", "stop")
    service.admission.release("b", "stop")  # twice: once counted
    service.admission.release("unknown")
    assert (in_flight("grpc"), in_flight("http")) == (1, 1)
    assert service.admission.queue.num_requests == 2  # the gauge is admission's count, split by front end


def test_a_speculating_engine_reports_its_proposals_in_its_stats_and_metrics(tmp_path):
    """An engine proposing n-gram tokens on prompts that repeat: its get_metrics carries the
    speculator's counts, and a worker's /metrics has them as counters (per position too),
    with the acceptance ratio and speed-up; an engine that does not speculate reports none."""
    _, path = make_tiny_model(tmp_path, dtype=torch.float64)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [12] + [9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    # Not adaptive: the off-switch follows measured step times, which a busy machine makes
    # say that proposals do not pay (this test is about the counts' way out, not about it).
    llm = LLM(path, dtype="float64", block_size=4, speculative="ngram", prompt_lookup_min=1, num_speculative_tokens=3,
              adaptive=False)
    llm.generate(prompts, params)
    stats = llm.get_metrics()
    spec = llm.engine.speculator.stats()
    assert stats.num_speculative_tokens == 3 and stats.spec_num_checks > 0
    assert stats.spec_num_proposed > stats.spec_num_accepted > 0  # some accepted, some not
    assert (stats.spec_num_checks, stats.spec_num_proposed, stats.spec_num_accepted, stats.spec_num_emitted) == (
        spec.num_checks, spec.num_proposed, spec.num_accepted, spec.num_emitted)
    assert stats.spec_acceptance_rate == spec.acceptance_rate
    assert stats.spec_proposed_by_position == spec.proposed_by_position and len(spec.proposed_by_position) == 3
    assert sum(stats.spec_accepted_by_position) == stats.spec_num_accepted
    assert stats.spec_num_emitted == stats.spec_num_accepted + stats.spec_num_checks  # one of the model's per check
    # num_emitted / (num_emitted - plain_steps_saved): a check costs at least a decode step.
    assert stats.spec_speedup == pytest.approx(spec.num_emitted / (spec.num_emitted - spec.plain_steps_saved))
    assert 0 < stats.spec_speedup <= stats.spec_num_emitted / stats.spec_num_checks

    samples = worker_samples(stats)
    assert value(samples, "baton_spec_decode_checks_total") == stats.spec_num_checks
    assert value(samples, "baton_spec_decode_proposed_tokens_total") == stats.spec_num_proposed
    assert value(samples, "baton_spec_decode_accepted_tokens_total") == stats.spec_num_accepted
    assert value(samples, "baton_spec_decode_emitted_tokens_total") == stats.spec_num_emitted
    assert value(samples, "baton_spec_decode_check_cost_steps_total") == pytest.approx(stats.spec_check_cost_steps)
    for position in (1, 2, 3):
        for name, counts in (("proposed", stats.spec_proposed_by_position),
                             ("accepted", stats.spec_accepted_by_position)):
            assert value(samples, f"baton_spec_decode_{name}_tokens_per_pos_total",
                         position=str(position)) == counts[position - 1]
    assert value(samples, "baton_spec_decode_acceptance_ratio") == pytest.approx(stats.spec_acceptance_rate)
    assert value(samples, "baton_spec_decode_speedup") == pytest.approx(stats.spec_speedup)

    plain = LLM(path, dtype="float64", block_size=4)
    plain.generate(prompts[:1], params)
    off = plain.get_metrics()
    assert (off.num_speculative_tokens, off.spec_num_proposed, off.spec_proposed_by_position) == (0, 0, ())
    samples = worker_samples(off)
    assert value(samples, "baton_spec_decode_proposed_tokens_total") == 0
    assert total(samples, "baton_spec_decode_accepted_tokens_per_pos_total") == 0  # no series
    assert not [name for name, _ in samples if name in ("baton_spec_decode_speedup",  # off: no ratios
                                                        "baton_spec_decode_acceptance_ratio")]


def worker_samples(stats) -> dict[tuple[str, tuple], float]:
    """A worker's /metrics text for an engine snapshot, parsed as scrape() parses it."""
    metrics = WorkerMetrics("m", "decode", CollectorRegistry())
    metrics.watch_engine(lambda: stats)
    samples = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples
