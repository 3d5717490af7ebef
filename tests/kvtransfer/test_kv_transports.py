"""KV transports end to end, over real processes on loopback: a deployment forced onto
Gloo serves the same tokens as transformers; a pair no transport can join is refused
when its channel opens (loudly, once) and its prompts are prefilled on the decode
worker; and a prefill worker that dies or freezes in the middle of copying into the
decode worker's cache (tests/support/faults/sitecustomize.py stalls it there) costs the
request a re-prefill, never a block or a wrong token.

The default, ipc, is what every other end-to-end test runs on (tests/serving/test_serving.py
checks it is what carried their handoffs)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from baton.cli.local import start_deployment
from baton.cli.status import diagnose
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from tests.support.tiny_models import hf_greedy, make_tiny_model

pytestmark = pytest.mark.timeout(600)

FAULTS = Path(__file__).resolve().parents[1] / "support" / "faults"
WORKER_ARGS = ["--dtype", "float64", "--block-size", "4", "--num-kv-blocks", "200"]
EVERY_PROMPT_HANDED_OFF = ["--max-prefill-queue-tokens", "0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-transports"), dtype=torch.float64)


def generate(gateway: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
    with grpc.insecure_channel(gateway) as channel:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True))
        return list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120).token_ids)


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return value


def test_a_deployment_forced_onto_gloo_serves_the_same_tokens(tiny, tmp_path):
    model, path = tiny
    deployment = start_deployment(path, tmp_path / "logs", worker_args=[*WORKER_ARGS, "--kv-transport", "gloo"],
                                  gateway_args=EVERY_PROMPT_HANDED_OFF)
    try:
        prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(lambda p: generate(deployment.gateway, p), prompts))
        assert outputs == [hf_greedy(model, p, 8) for p in prompts]
        for role in ("prefill", "decode"):
            stats = deployment.stats(role)
            assert [(t.transport, t.num_transfers, t.num_failures) for t in stats.kv_transports] == [
                ("gloo", 8, 0)], role
        deployment.wait_idle()
    finally:
        codes = deployment.stop()
    assert set(codes.values()) == {0}, deployment.logs()


def test_a_pair_no_transport_can_join_is_refused_at_channel_open(tiny, tmp_path):
    """The prefill worker forces gloo, the decode worker ipc: the decode worker refuses the
    channel before offering it, says why once in its log and in its stats (`baton status`
    makes a finding of it), and prefills the prompts itself."""
    model, path = tiny
    deployment = start_deployment(path, tmp_path / "logs", worker_args=WORKER_ARGS,
                                  prefill_args=["--kv-transport", "gloo"], decode_args=["--kv-transport", "ipc"],
                                  gateway_args=EVERY_PROMPT_HANDED_OFF)
    try:
        prompts = [list(range(7 + i, 27 + i)) for i in range(3)]
        assert [generate(deployment.gateway, p) for p in prompts] == [hf_greedy(model, p, 8) for p in prompts]
        decode = deployment.stats("decode")
        assert "prefill worker forces --kv-transport gloo and the decode worker ipc" in decode.kv_channel_refusal
        assert [(t.transport, t.num_transfers, t.num_failures) for t in decode.kv_transports] == [("none", 0, 3)]
        with deployment.channel(deployment.admin) as channel:
            status = deployment.admin_client(channel).get_deployment_status(timeout=10)
        findings = [f for worker in status.workers for f in diagnose(worker, 1.0)]
        assert [f.problem for f in findings if "refused" in f.problem] == ["KV channel refused"]
        deployment.wait_idle()  # nothing held on either side
        log = deployment.worker("decode").log()
        assert log.count("ERROR") == 1 and "no KV channel to prefill worker" in log
    finally:
        codes = deployment.stop()
    assert set(codes.values()) == {0}, deployment.logs()


def _stalling_deployment(path: str, tmp_path: Path, timeout_s: float):
    marker = tmp_path / "stalled-mid-copy"
    pythonpath = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": pythonpath, "BATON_TEST_STALL_MID_COPY": str(marker)}
    deployment = start_deployment(path, tmp_path / "logs", worker_args=WORKER_ARGS, env=env,
                                  decode_args=["--transfer-timeout-s", str(timeout_s)],
                                  gateway_args=EVERY_PROMPT_HANDED_OFF)
    return deployment, marker


def _decode_holds_nothing(deployment) -> bool:
    stats = deployment.stats("decode")
    return stats.num_kv_blocks_used == 0 and stats.num_running == 0 and stats.num_kv_handoffs_pending == 0


def test_a_prefill_worker_killed_mid_copy_costs_a_re_prefill_and_leaves_nothing(tiny, tmp_path):
    model, path = tiny
    before = shm_entries()
    deployment, marker = _stalling_deployment(path, tmp_path, timeout_s=60.0)
    try:
        prompt = list(range(3, 63))  # 15 blocks of 4 tokens
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(generate, deployment.gateway, prompt, 12)
            wait_for(lambda: marker.exists() and marker.read_text(), 60, "the prefill worker never began its copy")
            prefill = deployment.worker("prefill")
            assert int(marker.read_text()) == prefill.popen.pid
            killed_at = time.monotonic()
            prefill.popen.send_signal(signal.SIGKILL)
            tokens = pending.result(timeout=120)
        # The socket closed with the sender: the pull failed at once (not after its 60 s
        # timeout) and the decode worker prefilled the prompt itself.
        assert time.monotonic() - killed_at < 30
        assert tokens == hf_greedy(model, prompt, 12)
        decode = deployment.stats("decode")
        assert [(t.transport, t.num_transfers, t.num_failures) for t in decode.kv_transports] == [("ipc", 0, 1)]
        assert decode.num_kv_blocks_fenced == 0
        wait_for(lambda: _decode_holds_nothing(deployment), 30, "the decode worker kept blocks")
    finally:
        deployment.stop()
    assert shm_entries() <= before, "a segment was left in /dev/shm"


def test_a_frozen_prefill_worker_fences_the_blocks_it_may_still_write(tiny, tmp_path):
    """The sender stalls mid-copy but lives: the decode worker gives up after its transfer
    timeout, and the request is prefilled again in new blocks at once. The blocks the
    sender may still write stay fenced (shown by `baton status`) until it is gone; a
    prefill worker restarted in its place takes handoffs again."""
    model, path = tiny
    deployment, marker = _stalling_deployment(path, tmp_path, timeout_s=2.0)
    try:
        prompt = list(range(3, 63))
        started = time.monotonic()
        assert generate(deployment.gateway, prompt, 12) == hf_greedy(model, prompt, 12)
        assert marker.exists() and time.monotonic() - started < 60
        decode = deployment.stats("decode")
        assert decode.num_kv_blocks_fenced == 15 and decode.num_kv_blocks_used == 15
        with deployment.channel(deployment.admin) as channel:
            status = deployment.admin_client(channel).get_deployment_status(timeout=10)
        findings = [f for worker in status.workers for f in diagnose(worker, 1.0)]
        assert "KV blocks fenced" in [f.problem for f in findings]

        deployment.worker("prefill").popen.send_signal(signal.SIGKILL)  # its supervisor restarts it
        wait_for(lambda: deployment.stats("decode").num_kv_blocks_fenced == 0, 30, "the fence was never lifted")
        wait_for(lambda: _decode_holds_nothing(deployment), 30, "the decode worker kept blocks")
        deployment._env.pop("BATON_TEST_STALL_MID_COPY")
        deployment.restart(deployment.worker("prefill"))
        # Another prompt: the decode worker's prefix cache holds the first whole (it prefilled it).
        prompt = list(range(4, 64))
        assert generate(deployment.gateway, prompt, 12) == hf_greedy(model, prompt, 12)
        ipc = {t.transport: t for t in deployment.stats("decode").kv_transports}["ipc"]
        assert (ipc.num_transfers, ipc.num_failures) == (1, 1)
        deployment.wait_idle()
    finally:
        codes = deployment.stop()
    assert set(codes.values()) == {0}, deployment.logs()
