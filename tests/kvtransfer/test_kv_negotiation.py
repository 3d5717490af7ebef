"""Which transport a KV channel uses (kvtransfer/endpoint.py), and the refusals: a pair no
transport can join is refused at channel open, saying why, never by a failed send.

The CUDA cases need no GPU: an endpoint names its GPU by UUID, and the choice is made
from the endpoints alone (tests/gpu/test_gpu_handoff.py makes the same choices with the
UUID of a real GPU)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from baton.wire import convert, kv_convert
from baton.wire.internal.v1 import worker_pb2
from baton.wire.records import FieldError, OpenKvChannel
from engine.kv.cache import KVCache, KVLayout
from kvtransfer import KvEndpoint, KvLayoutSpec, Rendezvous, TransportRefusedError, choose_transport
from kvtransfer.endpoint import host_identity, local_endpoint, receiver_shares_cache

HOST_A, HOST_B = "boot-a/net:1", "boot-b/net:1"
GPU_0, GPU_1 = "GPU-0000", "GPU-1111"


def cpu(host: str, transport: str = "auto") -> KvEndpoint:
    return KvEndpoint(host, host, "cpu", "", transport)


def cuda(host: str, gpu: str, transport: str = "auto") -> KvEndpoint:
    return KvEndpoint(host, host, "cuda", gpu, transport)


@pytest.mark.parametrize("receiver, sender, chosen", [
    (cpu(HOST_A), cpu(HOST_A), "ipc"),  # one host: shared memory
    (cpu(HOST_A), cpu(HOST_B), "gloo"),
    (cuda(HOST_A, GPU_0), cuda(HOST_A, GPU_0), "ipc"),  # one GPU: CUDA IPC (NCCL could not)
    (cuda(HOST_A, GPU_1), cuda(HOST_A, GPU_0), "ipc"),  # two GPUs of one host
    (cuda(HOST_A, GPU_0), cuda(HOST_B, GPU_1), "nccl"),
    (cpu(HOST_A, "gloo"), cpu(HOST_A), "gloo"),  # forced by one side
    (cpu(HOST_A), cpu(HOST_A, "gloo"), "gloo"),
    (cuda(HOST_A, GPU_1, "nccl"), cuda(HOST_A, GPU_0, "nccl"), "nccl"),  # forced by both, two GPUs
    (cuda(HOST_B, GPU_1, "ipc"), cuda(HOST_B, GPU_0), "ipc"),
], ids=["cpu-one-host", "cpu-two-hosts", "one-gpu", "two-gpus-one-host", "two-hosts-cuda", "gloo-by-decode",
        "gloo-by-prefill", "nccl-by-both", "ipc-by-decode"])
def test_the_transport_chosen(receiver, sender, chosen):
    assert choose_transport(receiver, sender) == chosen


@pytest.mark.parametrize("receiver, sender, reason", [
    (cuda(HOST_A, GPU_0, "nccl"), cuda(HOST_A, GPU_0), "NCCL cannot run two ranks on one GPU"),
    (cuda(HOST_A, GPU_0), cuda(HOST_A, GPU_0, "nccl"), "NCCL cannot run two ranks on one GPU"),
    (cpu(HOST_A, "ipc"), cpu(HOST_B), "ipc needs both workers on one host"),
    (cuda(HOST_A, GPU_0), cuda(HOST_B, GPU_1, "ipc"), "ipc needs both workers on one host"),
    (cuda(HOST_A, GPU_0, "gloo"), cuda(HOST_B, GPU_1), "gloo moves CPU caches"),
    (cpu(HOST_A, "nccl"), cpu(HOST_B), "nccl moves CUDA caches"),
    (cpu(HOST_A, "gloo"), cpu(HOST_A, "ipc"), "prefill worker forces --kv-transport ipc and the decode worker gloo"),
    (cpu(HOST_A), cuda(HOST_A, GPU_0), "both must be on CPU, or both on CUDA"),
], ids=["nccl-one-gpu-decode", "nccl-one-gpu-prefill", "ipc-two-hosts", "ipc-two-hosts-cuda", "gloo-cuda",
        "nccl-cpu", "forced-apart", "cpu-and-cuda"])
def test_a_transport_that_cannot_work_is_refused_with_its_reason(receiver, sender, reason):
    with pytest.raises(TransportRefusedError, match=reason):
        choose_transport(receiver, sender)


def test_a_receiver_that_may_get_ipc_shares_its_cache():
    assert receiver_shares_cache("auto") and receiver_shares_cache("ipc")
    assert not receiver_shares_cache("gloo") and not receiver_shares_cache("nccl")
    with pytest.raises(ValueError, match="one of auto, ipc, nccl, gloo"):
        receiver_shares_cache("rdma")


def test_host_identity_is_the_kernel_and_the_network_namespace():
    """Two processes of this host agree; a process in another network namespace (what a
    Kubernetes pod or a test's `ip netns` host is) is another host."""
    here = local_endpoint("cpu", "auto")
    assert here.host_id == host_identity() and here.hostname
    script = "from kvtransfer.endpoint import host_identity; print(host_identity())"
    same = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert same.stdout.strip() == here.host_id
    if os.geteuid() != 0:
        pytest.skip("a network namespace of its own needs root (CI runs as root)")
    other = subprocess.run(["unshare", "--net", sys.executable, "-c", script], capture_output=True, text=True)
    assert other.returncode == 0, other.stderr
    boot, _, netns = here.host_id.partition("/")
    assert other.stdout.strip().startswith(boot + "/") and other.stdout.strip() != here.host_id


# ---------------------------------------------------------------- on the wire


def test_a_handle_names_where_its_kv_lives():
    endpoint = worker_pb2.KvEndpoint(hostname="p", host_id=HOST_A, device="cuda", gpu_uuid=GPU_0)
    handle = worker_pb2.KvHandle(prefill_endpoint=endpoint, layout=worker_pb2.KvLayout(
        num_layers=2, block_size=4, num_kv_heads=2, head_dim=16, dtype="float32"))
    read = kv_convert.kv_handle_from_pb(handle).prefill_endpoint
    assert (read.host_id, read.device, read.gpu_uuid, read.transport) == (HOST_A, "cuda", GPU_0, "auto")
    assert kv_convert.kv_handle_from_pb(kv_convert.kv_handle_to_pb(kv_convert.kv_handle_from_pb(handle))) == \
        kv_convert.kv_handle_from_pb(handle)


@pytest.mark.parametrize("endpoint, detail", [
    (None, "does not say where its KV lives"),
    (worker_pb2.KvEndpoint(hostname="p", host_id=HOST_A, device="tpu"), "device is cpu or cuda"),
    (worker_pb2.KvEndpoint(hostname="p", host_id=HOST_A, device="cpu", kv_transport="rdma"), "kv transport"),
    (worker_pb2.KvEndpoint(hostname="p" * 300, host_id=HOST_A, device="cpu"), "at most 255"),
])
def test_a_decode_request_whose_handle_misplaces_its_kv_is_refused_naming_the_field(endpoint, detail):
    from baton.wire.v1 import generation_pb2 as pb

    prompt = list(range(10, 18))
    handle = worker_pb2.KvHandle(
        prefill_worker_id="p", prefill_address="127.0.0.1:1", request_id="r", num_tokens=len(prompt), num_blocks=2,
        lease_ms=30_000, kv_token="t" * 32, prefill_endpoint=endpoint,
        layout=worker_pb2.KvLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=16, dtype="float32"))
    work = worker_pb2.WorkRequest(request_id="r", prompt_token_ids=prompt,
                                  sampling=pb.SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(FieldError, match=detail) as raised:
        convert.decode_request_from_pb(worker_pb2.DecodeRequest(request=work, first_token_id=3, kv_handle=handle))
    assert raised.value.field == "kv_handle.prefill_endpoint"


# ---------------------------------------------------------------- the prefill side checks the choice


class _Tally:
    class metrics:
        class channel_refusals:
            count = 0

            @classmethod
            def inc(cls):
                cls.count += 1


@pytest.mark.parametrize("decode_side, transport, reason", [
    (cuda(HOST_A, GPU_0), "nccl", "NCCL cannot run two ranks on one GPU"),  # chosen elsewhere, checked here
    (cuda(HOST_A, GPU_0, "gloo"), "gloo", "gloo moves CPU caches"),
    (cuda(HOST_A, GPU_1), "nccl", "the decode worker chose nccl, where this prefill worker's settings give ipc"),
])
def test_the_prefill_worker_refuses_a_channel_its_side_cannot_take(decode_side, transport, reason):
    from prefill_worker.kv_sender import KvSender

    cache = KVCache(KVLayout(2, 4, 2, 16, torch.float32), 8, 0)
    layout = KvLayoutSpec.from_kv_layout(cache.layout)
    sender = KvSender("p-0", engine=None, kv_cache=cache, layout=layout, endpoint=cuda(HOST_A, GPU_0),
                      lease_s=30.0, tally=_Tally())
    rendezvous = Rendezvous("d-0-x-0", "127.0.0.1", 1, 1.0, bytes(32), transport)
    # A caller naming no request held here: refused and counted, but a stranger's word
    # does not become what `baton status` reports of this worker.
    stranger = OpenKvChannel(rendezvous, layout, "decode-0", decode_side, "r", "x" * 32)
    refusals = _Tally.metrics.channel_refusals.count
    with pytest.raises(TransportRefusedError, match=reason):
        asyncio.run(sender.open_channel(stranger))
    assert sender.last_refusal == "" and not sender._channels
    assert _Tally.metrics.channel_refusals.count == refusals + 1
    # The decode worker it handed request r to: its refusal is the worker's state.
    sender.claim("r", "t" * 32)
    sender.hold("r", [1], num_tokens=4)
    request = OpenKvChannel(rendezvous, layout, "decode-0", decode_side, "r", "t" * 32)
    with pytest.raises(TransportRefusedError, match=reason):
        asyncio.run(sender.open_channel(request))
    assert reason.split(":")[0] in sender.last_refusal and not sender._channels
