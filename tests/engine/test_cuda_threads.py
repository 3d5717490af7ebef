"""Every thread that works for an engine on `cuda:N` makes `cuda:N` current first
(engine/runner/device.py): CUDA's current device is per thread, every thread starts on
device 0, and Triton launches on the current device whatever its tensors' device.

No GPU needed: `torch.cuda.set_device` is replaced by a recorder of each thread's
current device, and the engine, the caches and the transports are stand-ins whose
device is `cuda:1`. The work each thread does (a command, a step, an accept, a receive,
a send, checksums, a wait for a transfer in doubt, a close) records the device current
on its thread when it runs. On CPU nothing calls into torch.cuda at all.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from baton.wire.records import OpenKvChannel, SendKv, SendKvAccepted, SendKvDone
from decode_worker import kv_receiver
from decode_worker.kv_receiver import KvReceiver
from engine.async_engine import AsyncEngine
from engine.kv.cache import KVLayout
from kvtransfer import KvEndpoint, KvLayoutSpec, KvTransferError, Rendezvous, TransferStats
from kvtransfer.connect import ChannelOffer
from prefill_worker import kv_sender
from prefill_worker.kv_sender import KvSender

GPU_1 = torch.device("cuda", 1)
CPU = torch.device("cpu")
LAYOUT = KvLayoutSpec.from_kv_layout(KVLayout(2, 4, 2, 16, torch.float32))


class Devices:
    """Stands in for torch.cuda.set_device: each thread's current device, and every call."""

    def __init__(self) -> None:
        self._current = threading.local()
        self.calls: list[torch.device] = []
        self.work: list[tuple[str, str, torch.device | None]] = []  # (what, thread, device current)

    def set_device(self, device) -> None:
        self.calls.append(torch.device(device))
        self._current.device = torch.device(device)

    def saw(self, what: str) -> None:
        """`what` runs now on this thread: record the device current here."""
        self.work.append((what, threading.current_thread().name, getattr(self._current, "device", None)))

    def check(self, device: torch.device, expected_work: set[str]) -> None:
        assert {what for what, _, _ in self.work} >= expected_work, self.work
        assert all(thread != threading.main_thread().name for _, thread, _ in self.work), self.work
        if device.type == "cuda":
            assert [(what, seen) for what, _, seen in self.work if seen != device] == []
        else:
            assert self.calls == [] and all(seen is None for _, _, seen in self.work)


@pytest.fixture
def devices(monkeypatch) -> Devices:
    recorder = Devices()
    monkeypatch.setattr(torch.cuda, "set_device", recorder.set_device)
    return recorder


def _cache(device: torch.device):
    """A stand-in for a KVCache on `device` (the KV threads read its device only)."""
    return SimpleNamespace(blocks=SimpleNamespace(device=device))


def _endpoint(host: str, device: torch.device) -> KvEndpoint:
    return KvEndpoint(host, "boot/net:1", device.type, "GPU-1111" if device.type == "cuda" else "")


class _Transport:
    """An open channel's transport that records where each call runs."""

    backend = "ipc"
    is_broken = False

    def __init__(self, devices: Devices, num_receives_in_doubt_after: int | None = None) -> None:
        self.devices = devices
        self.num_receives_ok = num_receives_in_doubt_after  # then one fails in doubt
        self.closed = threading.Event()

    def recv_blocks(self, kv_cache, block_ids, tag, peer_block_ids) -> TransferStats:
        self.devices.saw("recv_blocks")
        if self.num_receives_ok == 0:
            raise KvTransferError("the sender stopped answering mid-copy", in_doubt=True)
        if self.num_receives_ok is not None:
            self.num_receives_ok -= 1
        return TransferStats(len(block_ids), 64, 0.01)

    def send_blocks(self, kv_cache, block_ids, tag, peer_block_ids) -> TransferStats:
        self.devices.saw("send_blocks")
        return TransferStats(len(block_ids), 64, 0.01)

    def wait_settled(self, timeout_s: float) -> bool:
        self.devices.saw("wait_settled")
        return True

    def close(self) -> None:
        self.devices.saw("close")
        self.closed.set()


async def _wait_closed(*transports: _Transport) -> None:
    for transport in transports:
        assert await asyncio.to_thread(transport.closed.wait, 5), "the transport was never closed"


# ------------------------------------------------------------------ engine thread
@pytest.mark.parametrize("device", [GPU_1, CPU], ids=str)
def test_the_engine_thread_makes_the_engines_device_current_first(devices, device):
    class FakeEngine:
        def __init__(self) -> None:
            self.device = device
            self.steps_left = 1
            self.scheduler = SimpleNamespace(requests={})

        def has_work(self) -> bool:
            return self.steps_left > 0

        def step(self):
            devices.saw("step")
            self.steps_left -= 1
            return SimpleNamespace(outputs=[], kv_receives=[])

    async def scenario() -> None:
        engine = AsyncEngine(FakeEngine())
        engine.start()
        try:
            await engine.call(lambda llm: devices.saw("command"))
            while await engine.call(lambda llm: llm.has_work()):
                await asyncio.sleep(0.01)
        finally:
            await engine.stop()

    asyncio.run(scenario())
    devices.check(device, {"command", "step"})


# ------------------------------------------------------------------ decode side
@pytest.mark.parametrize("device", [GPU_1, CPU], ids=str)
def test_the_receivers_threads_make_the_caches_device_current(devices, monkeypatch, device):
    """A channel's thread (its accept, receives, checksums and close) and the thread that
    waits out a transfer in doubt."""
    here = _endpoint("decode-host", device)
    # The first channel's second receive fails in doubt: its transport goes to a settling
    # thread, and the next pull opens a new one (closed with the receiver).
    transports = [_Transport(devices, num_receives_in_doubt_after=1), _Transport(devices)]

    def listen(channel_id, transport, host, kv_cache, timeout_s, ports):
        def accept():
            devices.saw("accept")
            return transports.pop(0)

        return ChannelOffer(Rendezvous(channel_id, "", 0, timeout_s, b"s" * 32, "ipc", "socket"), accept)

    class Call:
        def __init__(self) -> None:
            self.events = iter([SendKvAccepted([1, 2]), SendKvDone([7, 7], 64, 0.01)])

        async def next_event(self):
            return next(self.events)

        def cancel(self) -> None:
            pass

    class Client:
        address = "prefill:1"

        async def open_kv_channel(self, request, timeout, metadata):
            pass

        def send_kv(self, request, timeout, metadata):
            return Call()

        async def close(self) -> None:
            pass

    def checksums(kv_cache, block_ids):
        devices.saw("checksums")
        return [7] * len(block_ids)

    monkeypatch.setattr(kv_receiver, "listen", listen)
    monkeypatch.setattr(kv_receiver, "PrefillWorkerClient", lambda address, tls: Client())
    monkeypatch.setattr(kv_receiver, "block_checksums", checksums)
    tally = SimpleNamespace(done=lambda *args: None, failed=lambda transport: None)
    handle = SimpleNamespace(request_id="r", kv_token="t" * 32, num_blocks=2, prefill_address="prefill:1",
                             prefill_endpoint=here)

    async def scenario() -> None:
        receiver = KvReceiver("decode-0", _cache(device), LAYOUT, here, host="", timeout_s=5.0, verify=True,
                              tally=tally)
        opened = transports[:]
        try:
            assert (await receiver.receive(handle, [5, 6])).ok
            doubtful = await receiver.receive(handle, [5, 6])
            assert not doubtful.ok and doubtful.settled is not None
            await asyncio.wait_for(doubtful.settled, 5)
            assert (await receiver.receive(handle, [5, 6])).ok and not transports
        finally:
            await receiver.close()
        await _wait_closed(*opened)

    asyncio.run(scenario())
    devices.check(device, {"accept", "recv_blocks", "checksums", "wait_settled", "close"})


# ------------------------------------------------------------------ prefill side
@pytest.mark.parametrize("device", [GPU_1, CPU], ids=str)
def test_the_senders_threads_make_the_caches_device_current(devices, monkeypatch, device):
    """A channel's thread: its join, sends, checksums and close."""
    transport = _Transport(devices)

    def join(rendezvous, kv_cache, cancelled):
        devices.saw("join")
        return transport

    def checksums(kv_cache, block_ids):
        devices.saw("checksums")
        return [7] * len(block_ids)

    class Engine:
        async def call(self, command):
            return command(SimpleNamespace(release_kv=lambda request_id: True))

    monkeypatch.setattr(kv_sender, "join", join)
    monkeypatch.setattr(kv_sender, "block_checksums", checksums)
    tally = SimpleNamespace(done=lambda *args: None, failed=lambda transport: None)

    async def scenario() -> None:
        sender = KvSender("prefill-0", Engine(), _cache(device), LAYOUT, _endpoint("prefill-host", device),
                          lease_s=30.0, tally=tally)
        opened = await sender.open_channel(OpenKvChannel(
            Rendezvous("c-0", "", 0, 5.0, b"s" * 32, "ipc", "socket"), LAYOUT, "decode-0",
            _endpoint("decode-host", device)))
        assert opened.backend == "ipc"
        sender.claim("r", "t" * 32)
        sender.hold("r", [3, 4], num_tokens=8)
        events = [event async for event in sender.send(SendKv("c-0", "r", 1, 2, [5, 6], True, "t" * 32))]
        assert isinstance(events[-1], SendKvDone) and events[-1].block_checksums == [7, 7]
        await sender.close()
        await _wait_closed(transport)

    asyncio.run(scenario())
    devices.check(device, {"join", "send_blocks", "checksums", "close"})
