"""Many workers on many hosts: network namespaces stand in for hosts (baton/devtools/netns.py),
each worker bound to its own host's address only, found by the gateway through DNS names
that the test rewrites while requests run (each namespace's /etc/hosts), its KV crossing
hosts over Gloo on a fixed port range (and over ipc between workers of one host).

    gw: gateway       h1: prefill-0, decode-0       h2: prefill-1 (+ decode-2, started mid-run)
                      h3: decode-1 (taken out of DNS mid-run, then drained)

Every stream must equal transformers' greedy tokens, none may fail, and no worker may be
left holding a KV block.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from baton.devtools import netns
from baton.devtools.multihost import MultiHost
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from tests.support.tiny_models import hf_greedy, make_tiny_model

pytestmark = pytest.mark.timeout(900)

VOCAB_SIZE = 49152  # SmolLM2's tokenizer, saved beside the model
MAX_TOKENS = 16
NUM_STREAMS = 32


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from engine.tokenizer import load_tokenizer

    directory = tmp_path_factory.mktemp("tiny-multihost")
    model, path = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64, vocab_size=VOCAB_SIZE)
    load_tokenizer("smollm2-135m").save_pretrained(directory)
    return model, path


@pytest.fixture
def network():
    reason = netns.available()
    if reason:
        if os.environ.get("CI"):  # CI runs as root: there, a missing namespace is a failure
            pytest.fail(reason)
        pytest.skip(reason)
    netns.Network.cleanup_stale()
    with netns.Network(["gw", "h1", "h2", "h3"]) as net:
        yield net


def _stream(stub, prompt: list[int], request_id: str, max_tokens: int) -> list[int]:
    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [t for message in stub.GenerateStream(request, timeout=300) for t in message.token_ids]


def test_workers_on_many_hosts_found_by_dns(tiny_model, network, tmp_path):
    """Two waves of 32 concurrent streams: a decode worker starts during the first and is
    found through DNS (the second reaches it); one leaves DNS during the second and drains."""
    model, path = tiny_model
    rng = random.Random(16)
    waves = [[[rng.randrange(100, VOCAB_SIZE) for _ in range(rng.randrange(6, 40))] for _ in range(NUM_STREAMS)]
             for _ in range(2)]
    # The second wave's streams are longer: they are still running when a worker leaves.
    max_tokens = [MAX_TOKENS, 3 * MAX_TOKENS]
    expected = [[hf_greedy(model, prompt, n) for prompt in wave] for wave, n in zip(waves, max_tokens)]

    cluster = MultiHost.start(
        network, path, tmp_path / "logs", gateway="gw",
        prefill=[("prefill-0", "h1"), ("prefill-1", "h2")], decode=[("decode-0", "h1"), ("decode-1", "h3")],
        worker_args=["--dtype", "float64", "--block-size", "4", "--num-kv-blocks", "800", "--grace-s", "60"],
        prefill_args=["--max-num-batched-tokens", "48"], decode_args=["--max-num-batched-tokens", "64"],
        # Every prompt is handed off (none prefilled where it decodes); bursts are queued.
        gateway_args=["--max-prefill-queue-tokens", "0", "--max-queued-tokens", "100000"],
    )
    stopped = False
    try:
        deployment = cluster.deployment
        with grpc.insecure_channel(deployment.gateway) as channel, ThreadPoolExecutor(NUM_STREAMS) as pool:
            stub = generation_pb2_grpc.GenerationStub(channel)

            def wave(index: int) -> list:
                return [pool.submit(_stream, stub, prompt, f"wave{index}-{i}", max_tokens[index])
                        for i, prompt in enumerate(waves[index])]

            first = wave(0)
            # A decode worker joins while those run: started, listed in DNS, routed to.
            cluster.add("decode", "decode-2", "h2")
            results = [[future.result() for future in first]]
            second = wave(1)
            # One leaves while these run (once it has some: on CI's busy cores they may take a
            # while to arrive): out of DNS, the gateway routes it nothing new; then SIGTERM,
            # and what runs there finishes within its grace period.
            # (The poll that saw its work is the one kept: short requests may finish between two polls.)
            worker = cluster.process("decode-1")
            deadline = time.monotonic() + 60
            in_flight = deployment.stats(worker)
            while not _has_work(in_flight) and time.monotonic() < deadline:
                time.sleep(0.01)
                in_flight = deployment.stats(worker)
            leaving = cluster.unlist("decode-1")
            leaving.popen.send_signal(signal.SIGTERM)
            assert leaving.popen.wait(timeout=120) == 0, deployment.logs()
            deployment.processes.remove(leaving)
            results.append([future.result() for future in second])
        for w, (got_wave, want_wave) in enumerate(zip(results, expected)):
            for i, (got, want) in enumerate(zip(got_wave, want_wave)):
                assert got == want, f"wave {w} stream {i}: {got} != {want}"

        idle = deployment.wait_idle(timeout_s=60)
        # The new worker took requests; the one that left had some in flight, which finished.
        assert idle["decode-2"].num_finished > 0
        assert in_flight.worker_id == "decode-1"
        assert _has_work(in_flight), in_flight
        # KV crossed hosts (Gloo) and moved within one (ipc), counted where it was sent.
        sent = {}
        for name in ("prefill-0", "prefill-1"):
            stats = idle[name]
            assert stats.num_transfer_failures == 0, (name, stats)
            for transport in stats.kv_transports:
                sent[transport.transport] = sent.get(transport.transport, 0) + transport.num_transfers
        assert sent.get("gloo", 0) > 0 and sent.get("ipc", 0) > 0, sent
        # Each worker listened on its own host's address only.
        addresses = {process.address.rsplit(":", 1)[0] for process in [*deployment.processes, leaving]}
        assert addresses == {network.address(host) for host in ("gw", "h1", "h2", "h3")}
        codes = cluster.stop()
        stopped = True
        assert set(codes.values()) == {0}, (codes, deployment.logs())
    finally:
        if not stopped:
            cluster.stop()


def _has_work(stats) -> bool:
    return stats.num_running + stats.num_waiting + stats.num_kv_handoffs_pending > 0
