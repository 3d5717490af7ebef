"""The KV handoff on a CUDA GPU (marker `gpu`: skipped without one; `make test-gpu`).

Two processes on one GPU move blocks over ipc (a CUDA IPC handle of the decode side's
cache), bitwise and checksummed, scattered and contiguous; the transport chosen for
two workers on one GPU is ipc, and NCCL is refused there at channel open; a decode
process killed mid-transfer leaves the sender serving with a healthy CUDA context, a
prefill process killed mid-transfer fails the receiver at once and leaves nothing held;
and `baton up --device cuda` serves disaggregated on one GPU with KV over ipc.

NCCL between two GPUs needs a machine with two: not covered here.

The tests that start processes on the GPU are marked `gpu_servers`: `make test-gpu` runs
them in a pytest process of their own, which holds no GPU memory, and none leaves a process
behind (`spawned` kills what a failed test left running), so each finds the GPU free.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import signal
import time
import traceback

import pytest
import torch

from kvtransfer import KvEndpoint, KvTransferError, TransportRefusedError, block_checksums, choose_transport
from kvtransfer.connect import join, listen
from kvtransfer.endpoint import gpu_uuid, local_endpoint
from tests.serving.test_device import baton_up_streams_text
from tests.kvtransfer.test_kv_ipc import die_right_after_go, stop_after_first_copy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

POOL = 64
# Llama-3.1-8B's block shape: 32 layers x 8 KV heads x 128, 16 tokens, bfloat16 (2 MiB a block).
LAYOUT = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def _cache(seed: int | None, *, shareable: bool = False):
    from engine.kv.cache import KVCache, KVLayout

    cache = KVCache(KVLayout(**LAYOUT), POOL, 0, "cuda:0", shareable=shareable)
    if seed is None:
        cache.blocks.fill_(-7.0)
    else:  # random bits, made on the CPU so both processes can rebuild them
        generator = torch.Generator().manual_seed(seed)
        bits = torch.randint(0, 256, cache.blocks.view(torch.uint8).shape, dtype=torch.uint8, generator=generator)
        cache.blocks.view(torch.uint8).copy_(bits)
    return cache


TRANSFERS = [
    (list(range(2, 18)), list(range(30, 46))),  # contiguous on both sides
    (torch.randperm(POOL, generator=torch.Generator().manual_seed(3))[:12].tolist(),
     torch.randperm(POOL, generator=torch.Generator().manual_seed(4))[:12].tolist()),  # scattered
]


def _child(role, rendezvous_queue, results, *args) -> None:
    try:
        torch.cuda.set_device(0)
        results.put(("ok", role.__name__, role(rendezvous_queue, *args)))
    except BaseException:
        results.put(("error", role.__name__, traceback.format_exc()))


@pytest.fixture
def spawned():
    """`start(roles, *args)`: each role in a spawned process of its own; returns the processes
    by role name, the results queue and the rendezvous queue. Whatever is still running when
    the test ends (a test failed before its peers finished) is killed then, so that no process
    holds the GPU into the next test."""
    started = []

    def start(roles, *args):
        ctx = mp.get_context("spawn")
        rendezvous_queue, results = ctx.Queue(), ctx.Queue()
        processes = {role.__name__: ctx.Process(target=_child, args=(role, rendezvous_queue, results, *args),
                                                daemon=True)
                     for role in roles}
        for process in processes.values():
            process.start()
            started.append(process)
        return processes, results, rendezvous_queue

    yield start
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(timeout=30)


def _collect(processes, results, names, timeout_s: float = 300.0) -> dict:
    outcomes, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(outcomes) < len(names):
            status, name, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            outcomes[name] = (status, value)
    except queue.Empty:
        pass
    finally:
        for process in processes.values():
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    errors = [f"--- {n} ---\n{v}" for n, (status, v) in outcomes.items() if status == "error"]
    missing = set(names) - set(outcomes)
    if errors or missing:
        pytest.fail("\n".join(errors + [f"{n} did not report" for n in missing]))
    return {name: value for name, (_, value) in outcomes.items()}


def gpu_sender(rendezvous_queue) -> list[list[int]]:
    cache = _cache(seed=1)
    channel = join(rendezvous_queue.get(timeout=120), cache)
    assert channel.backend == "ipc"
    sums = []
    for tag, (src, dst) in enumerate(TRANSFERS, start=1):
        channel.send_blocks(cache, src, tag, dst)
        sums.append(block_checksums(cache, src))
    channel.close()
    return sums


def gpu_receiver(rendezvous_queue) -> list[list[int]]:
    cache = _cache(seed=None, shareable=True)
    offer = listen("gpu-ipc", "ipc", "", cache, 120.0)
    rendezvous_queue.put(offer.rendezvous)
    channel = offer.accept()
    expected = _cache(seed=1)
    written, sums = set(), []
    for tag, (src, dst) in enumerate(TRANSFERS, start=1):
        channel.recv_blocks(cache, dst, tag, src)
        written |= set(dst)
        assert torch.equal(cache.block_rows.view(torch.uint8)[dst], expected.block_rows.view(torch.uint8)[src])
        untouched = sorted(set(range(POOL)) - written)
        assert bool((cache.block_rows[untouched] == -7.0).all())
        sums.append(block_checksums(cache, dst))
    channel.close()
    return sums


@pytest.mark.gpu_servers
def test_two_processes_on_one_gpu_move_blocks_over_cuda_ipc(spawned):
    processes, results, _queue = spawned((gpu_receiver, gpu_sender))
    outcome = _collect(processes, results, ["gpu_receiver", "gpu_sender"])
    assert outcome["gpu_receiver"] == outcome["gpu_sender"]


def test_on_one_gpu_the_transport_is_ipc_and_nccl_is_refused():
    here = local_endpoint("cuda", "auto", gpu_uuid(torch.device("cuda", 0)))
    assert choose_transport(here, here) == "ipc"
    forced = local_endpoint("cuda", "nccl", here.gpu_uuid)
    with pytest.raises(TransportRefusedError, match="NCCL cannot run two ranks on one GPU"):
        choose_transport(forced, here)
    # A peer's GPU elsewhere (another host): NCCL is the choice. Not run: it needs two GPUs.
    elsewhere = KvEndpoint("other-host", "other-boot/net:1", "cuda", "GPU-elsewhere")
    assert choose_transport(here, elsewhere) == "nccl"


def surviving_gpu_sender(rendezvous_queue, receiver_gone) -> dict:
    from kvtransfer.ipc import IpcChannel

    copy = IpcChannel._copy

    def copy_once_the_receiver_is_gone(self, *args):
        # Past the GO, into memory whose exporter has died: what the sender must survive.
        receiver_gone.wait(120)
        time.sleep(1.0)
        return copy(self, *args)

    IpcChannel._copy = copy_once_the_receiver_is_gone
    cache = _cache(seed=2)
    channel = join(rendezvous_queue.get(timeout=120), cache)
    try:
        channel.send_blocks(cache, list(range(40)), 1, list(range(10, 50)))
        message = ""
    except KvTransferError as error:
        message = str(error)
    time.sleep(1.0)
    broken, released = channel.is_broken, channel._peer_rows is None
    # The CUDA context survived: kernels still run and give the right answer.
    healthy = bool((torch.ones(1024, device="cuda") * 2).sum().item() == 2048)
    torch.cuda.synchronize()
    return {"message": message, "broken": broken, "released": released, "healthy": healthy}


def dying_gpu_receiver(rendezvous_queue, receiver_gone) -> None:
    die_right_after_go()
    cache = _cache(seed=None, shareable=True)
    offer = listen("gpu-dying", "ipc", "", cache, 120.0)
    rendezvous_queue.put(offer.rendezvous)
    channel = offer.accept()
    channel.recv_blocks(cache, list(range(10, 50)), 1, list(range(40)))


@pytest.mark.gpu_servers
def test_a_decode_process_killed_mid_transfer_leaves_the_sender_serving(spawned):
    ctx = mp.get_context("spawn")
    receiver_gone = ctx.Event()
    processes, results, _queue = spawned((dying_gpu_receiver, surviving_gpu_sender), receiver_gone)
    processes["dying_gpu_receiver"].join(300)
    assert processes["dying_gpu_receiver"].exitcode == -signal.SIGKILL
    receiver_gone.set()
    sender_side = _collect({"surviving_gpu_sender": processes["surviving_gpu_sender"]}, results,
                           ["surviving_gpu_sender"])["surviving_gpu_sender"]
    assert sender_side["broken"] and sender_side["released"] and sender_side["healthy"], sender_side


def dying_gpu_sender(rendezvous_queue, mid_copy) -> None:
    cache = _cache(seed=3)
    channel = join(rendezvous_queue.get(timeout=120), cache)
    stop_after_first_copy(lambda: (torch.cuda.synchronize(), mid_copy.set(), time.sleep(600)))  # killed there
    channel.send_blocks(cache, [1, 2, 3, 10, 20, 30], 1, [5, 6, 7, 8, 9, 11])


def surviving_gpu_receiver(rendezvous_queue, mid_copy) -> dict:
    cache = _cache(seed=None, shareable=True)
    offer = listen("gpu-sender-dies", "ipc", "", cache, 30.0)
    rendezvous_queue.put(offer.rendezvous)
    channel = offer.accept()
    started = time.monotonic()
    try:
        channel.recv_blocks(cache, [5, 6, 7, 8, 9, 11], 1, [1, 2, 3, 10, 20, 30])
        error = None
    except KvTransferError as raised:
        error = raised
    waited = time.monotonic() - started
    settled = channel.wait_settled(10.0)
    untouched = sorted(set(range(POOL)) - {5, 6, 7, 8, 9, 11})
    healthy = bool((torch.ones(1024, device="cuda") * 2).sum().item() == 2048)
    return {"failed": error is not None, "message": str(error), "waited": waited, "settled": settled,
            "broken": channel.is_broken, "healthy": healthy, "mid_copy": mid_copy.is_set(),
            "untouched": bool((cache.block_rows[untouched] == -7.0).all())}


@pytest.mark.gpu_servers
def test_a_prefill_process_killed_mid_transfer_fails_the_receiver_at_once_and_leaks_nothing(spawned):
    """The CUDA IPC sender killed between two copies into the decode side's cache: the
    receiver fails at once (the socket closed with it), not at its timeout; its blocks outside
    the transfer are untouched, its CUDA context healthy, and the channel settles (so the
    decode worker frees the request's blocks: nothing leaks)."""
    ctx = mp.get_context("spawn")
    mid_copy = ctx.Event()
    processes, results, _queue = spawned((surviving_gpu_receiver, dying_gpu_sender), mid_copy)
    assert mid_copy.wait(300), "the sender never reached the middle of its copy"
    killed_at = time.monotonic()
    os.kill(processes["dying_gpu_sender"].pid, signal.SIGKILL)
    receiver = _collect({"surviving_gpu_receiver": processes["surviving_gpu_receiver"]}, results,
                        ["surviving_gpu_receiver"])["surviving_gpu_receiver"]
    assert time.monotonic() - killed_at < 60 and receiver["waited"] < 25.0, receiver
    assert receiver["failed"] and "gone" in receiver["message"], receiver
    assert receiver["settled"] and receiver["broken"] and receiver["untouched"] and receiver["healthy"], receiver


@pytest.mark.gpu_servers
def test_baton_up_disaggregated_on_one_gpu_hands_kv_over_ipc(tmp_path):
    status = baton_up_streams_text(tmp_path, ["--device", "cuda", "--model", "dummy:llama-3.1-8b",
                                              "--gpu-memory-utilization", "0.85", "--max-model-len", "4096"],
                                   colocated=False)
    assert re.search(r"KV ipc +[1-9][0-9]* transfers, 0 failed", status), status
    assert "KV channel refused" not in status and re.search(r"refused +none", status), status
