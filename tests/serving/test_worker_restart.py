"""A prefill worker restarted on its address takes handoffs again: the decode worker's
KV channel to the old process is gone with it, and the next pull opens a new one
(it used to keep sending on the dead channel, refused for good, and prefill every
prompt itself)."""

from __future__ import annotations

import signal
import subprocess
import time

import grpc
import pytest
import torch

from baton.cli.local import Process, start_deployment, wait_in_rotation, wait_serving
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)


def generate(gateway: str, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(gateway) as channel:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=4))
        return list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60).token_ids)


def test_a_restarted_prefill_worker_takes_handoffs_again(tmp_path):
    _, model_dir = make_tiny_model(tmp_path / "model", "llama", 4, 2, 16, True, dtype=torch.float32)
    deployment = start_deployment(
        model_dir, tmp_path / "logs",
        worker_args=["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "200"],
        gateway_args=["--max-prefill-queue-tokens", "0"],  # every prompt is handed off
    )
    try:
        prompt = list(range(10, 40))
        expected = generate(deployment.gateway, prompt)
        assert deployment.stats("prefill").num_transfers == 1

        old = deployment.worker("prefill")
        old.popen.send_signal(signal.SIGTERM)
        assert old.popen.wait(timeout=60) == 0
        log = open(tmp_path / "logs" / "prefill-restarted.log", "w")
        restarted = Process("prefill", old.address, subprocess.Popen(old.popen.args, stdout=log,
                                                                      stderr=subprocess.STDOUT), log.name)
        deployment.processes[deployment.processes.index(old)] = restarted
        wait_serving(restarted.address, deployment, 300)
        wait_in_rotation(deployment.admin, deployment, 60)

        for _ in range(3):  # the first pull may still find the old channel; later ones must not
            assert generate(deployment.gateway, prompt) == expected
        assert deployment.stats("prefill").num_transfers >= 1, deployment.logs()
    finally:
        codes = deployment.stop()
    assert set(codes.values()) == {0}, deployment.logs()


def gateway_health(gateway: str) -> int | None:
    """The gateway's overall health status, None if it does not answer."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(gateway) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return None


def wait_for(predicate, timeout_s: float) -> float:
    """Seconds until `predicate()` held; AssertionError after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


def test_the_gateway_is_not_serving_while_no_decode_worker_is_up(tmp_path):
    """Its only decode worker killed (-9), the gateway turns NOT_SERVING, so that a load
    balancer sends clients elsewhere; the worker back on its address, SERVING again."""
    from grpc_health.v1 import health_pb2

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    _, model_dir = make_tiny_model(tmp_path / "model", "llama", 4, 2, 16, True, dtype=torch.float32)
    deployment = start_deployment(model_dir, tmp_path / "logs", prefill=False,
                                  worker_args=["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "200"])
    try:
        assert gateway_health(deployment.gateway) == serving
        old = deployment.worker("decode")
        old.popen.kill()
        old.popen.wait(timeout=30)
        wait_for(lambda: gateway_health(deployment.gateway) == not_serving, timeout_s=10)

        log = open(tmp_path / "logs" / "decode-restarted.log", "w")
        restarted = Process("decode", old.address, subprocess.Popen(old.popen.args, stdout=log,
                                                                     stderr=subprocess.STDOUT), log.name)
        deployment.processes[deployment.processes.index(old)] = restarted
        wait_serving(restarted.address, deployment, 300)
        rejoined_s = wait_for(lambda: gateway_health(deployment.gateway) == serving, timeout_s=10)
        assert rejoined_s < 2.0, f"serving again {rejoined_s:.1f} s after the worker was"
        assert len(generate(deployment.gateway, list(range(10, 30)))) == 4
    finally:
        codes = deployment.stop()
    assert set(codes.values()) == {0}, deployment.logs()
