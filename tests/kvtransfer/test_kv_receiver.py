"""The decode worker's KV receiver, around its transport: a pull cancelled (once or twice)
returns only once the receive writing into its blocks has ended, and a pull that fails
in a way nobody foresaw is still reported, never raised (the request would otherwise
stay RECEIVING with its blocks for good). And the decode worker shares its cache for ipc
once, at startup, before anything steps."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from baton.runtime.settings import DecodeWorkerSettings
from baton.wire.records import SendKvAccepted, SendKvDone, WorkerStats
from decode_worker import kv_receiver
from decode_worker.kv_receiver import KvReceiver, _Channel
from decode_worker.server import DecodeWorkerService
from engine.kv.cache import KVCache, KVLayout
from kvtransfer import KvEndpoint, TransferStats, TransportRefusedError, ipc_memory
from tests.support.tiny_models import make_tiny_model

HERE = KvEndpoint("decode-host", "boot/net:1", "cpu")
CACHE = KVCache(KVLayout(2, 4, 2, 16, torch.float32), 8, 0)


class _SlowTransport:
    """A receive that keeps writing into its blocks for a second."""

    backend = "ipc"
    is_broken = False

    def __init__(self) -> None:
        self.finished = threading.Event()

    def recv_blocks(self, kv_cache, block_ids, tag, peer_block_ids) -> TransferStats:
        time.sleep(1.0)
        self.finished.set()
        return TransferStats(len(block_ids), 0, 1.0)

    def close(self) -> None:
        pass


class _Call:
    def __init__(self) -> None:
        self.events = iter([SendKvAccepted([1, 2]), SendKvDone([], 0, 0.0)])

    async def next_event(self):
        return next(self.events)

    def cancel(self) -> None:
        pass


class _Client:
    address = "prefill:1"

    def send_kv(self, request, timeout, metadata):
        return _Call()


class _Handle:
    request_id = "r"
    kv_token = "t" * 32
    num_blocks = 2
    prefill_address = "prefill:1"
    prefill_endpoint = HERE


class _Tally:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def failed(self, transport: str) -> None:
        self.failures.append(transport)


def _receiver(tally=None) -> KvReceiver:
    return KvReceiver("decode-0", kv_cache=CACHE, layout=None, endpoint=HERE, host="", timeout_s=5.0, verify=False,
                      tally=tally or _Tally())


@pytest.mark.parametrize("cancels", [1, 2, 3])
def test_a_cancelled_pull_returns_only_once_its_receive_has_ended(cancels):
    async def scenario() -> bool:
        channel = _Channel("prefill:1", 0, CACHE.blocks.device)
        transport = channel.transport = _SlowTransport()
        pull = asyncio.create_task(_receiver()._pull(_Client(), channel, "ipc", _Handle(), [5, 6], None))
        await asyncio.sleep(0.2)  # the receive is writing
        for _ in range(cancels):
            pull.cancel()
            await asyncio.sleep(0.05)
        with pytest.raises(asyncio.CancelledError):
            await pull
        channel.close()
        return transport.finished.is_set()

    assert asyncio.run(scenario()), "the pull returned while its receive was still writing into the blocks"


def test_an_unforeseen_failure_is_reported_not_raised(monkeypatch):
    """A socket the process cannot have (EMFILE) while offering a channel."""

    def no_socket(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(kv_receiver, "listen", no_socket)
    monkeypatch.setattr(kv_receiver, "PrefillWorkerClient", lambda address, tls: _Client())
    tally = _Tally()

    async def scenario():
        receiver = _receiver(tally)
        result = await receiver.receive(_Handle(), [5, 6])
        await asyncio.sleep(0)
        return result

    result = asyncio.run(scenario())
    assert not result.ok and "Too many open files" in result.error and result.settled is None
    assert tally.failures == ["ipc"]


def test_a_prefill_worker_this_worker_cannot_reach_is_one_clear_error(monkeypatch, caplog):
    """Across hosts, a prefill worker whose advertised address cannot be reached from here is
    a deployment's error: every pull from it fails alike. Said once, loudly, with what to
    check, and kept as the worker's refusal (a `baton status` finding); each request is
    prefilled here. A peer that was reachable once and is gone later is lost, not that."""
    from kvtransfer.connect import ChannelOffer
    from kvtransfer.transport import Rendezvous

    class Unreachable(_Client):
        address = "10.9.9.9:50061"

        async def open_kv_channel(self, request, timeout, metadata):
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="failed to connect to all addresses")

    def offer(*args, **kwargs):
        gone = threading.Event()

        def accept():
            gone.wait(5)
            raise kv_receiver.KvTransferError("cancelled")

        return ChannelOffer(Rendezvous("c", "10.0.0.2", 41000, 5.0, b"s" * 32, "gloo"), accept, gone.set)

    monkeypatch.setattr(kv_receiver, "listen", offer)
    monkeypatch.setattr(kv_receiver, "PrefillWorkerClient", lambda address, tls: Unreachable())

    class Remote(_Handle):
        prefill_address = "10.9.9.9:50061"
        prefill_endpoint = KvEndpoint("prefill-host", "boot/net:2", "cpu")

    async def scenario():
        receiver = _receiver()
        results = [await receiver.receive(Remote(), [5, 6]) for _ in range(3)]
        return receiver, results

    with caplog.at_level("ERROR", logger=kv_receiver.__name__):
        receiver, results = asyncio.run(scenario())
    assert all(not r.ok and r.transport == "gloo" and "UNAVAILABLE" in r.error for r in results)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "10.9.9.9:50061" in errors[0] and "--advertise" in errors[0], errors
    assert "cannot reach each other" in receiver.last_refusal


@pytest.mark.parametrize("kv_transport, num_exports", [("auto", 1), ("gloo", 0)])
def test_the_decode_worker_shares_its_cache_once_before_anything_steps(tmp_path, monkeypatch, kv_transport,
                                                                        num_exports):
    """A CUDA export (torch's _share_cuda_) replaces the cache storage's data pointer: made
    on the event loop when the first channel was offered, it raced the engine thread's steps
    reading the cache. A decode worker that may use ipc now exports at startup, as its engine
    thread's first command, and a channel offered later reuses that export (on CPU the
    memfd export goes through the same export_cache)."""
    exports = []
    export = ipc_memory._export

    def counted(kv_cache):
        exports.append((threading.current_thread().name, service.engine.num_steps))
        return export(kv_cache)

    monkeypatch.setattr(ipc_memory, "_export", counted)
    _, model_dir = make_tiny_model(tmp_path, "llama", 4, 2, 16, True, dtype=torch.float32)
    settings = DecodeWorkerSettings(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=64, threads=1,
                                    kv_transport=kv_transport)
    service = DecodeWorkerService(settings)

    class Refusing(_Client):
        async def open_kv_channel(self, request, timeout, metadata):
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), details="no")

    async def scenario() -> list:
        await service.load("127.0.0.1:0")
        try:
            at_start = list(exports)
            if num_exports:  # a channel offered later (the prefill worker refuses it)
                channel = _Channel("prefill:1", 0, service.receiver.device)
                with pytest.raises(TransportRefusedError):
                    await service.receiver._open(Refusing(), channel, "ipc", SimpleNamespace(request_id="r", kv_token="t" * 32),
                                                 None)
                channel.close()
            return at_start
        finally:
            await service.stop()

    at_start = asyncio.run(scenario())
    assert at_start == [("engine", 0)] * num_exports, "exported on the engine thread before its first step"
    assert exports == at_start, "a channel offered later reuses the export"


class _Peers:
    """The prefill worker's GetStats, as the receiver's client sees it."""

    def __init__(self, endpoint: KvEndpoint | None) -> None:
        self.endpoint = endpoint
        self.polls = 0

    async def get_stats(self, timeout: float):
        self.polls += 1
        if self.endpoint is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="down")
        return WorkerStats(worker_id="prefill-0", role="prefill", serving=True, kv_endpoint=self.endpoint)


class _DoneTally(_Tally):
    class metrics:
        class channel_refusals:
            @staticmethod
            def inc() -> None:
                pass

    def done(self, transport: str, num_bytes: int, seconds: float, verified: bool = False) -> None:
        pass


@pytest.mark.parametrize("own, pulled, reported", [
    (HERE, "ipc", False),  # the handle lied: the prefill worker's own endpoint joins ours, and is used
    (KvEndpoint("gpu-host", "boot-g/net:1", "cuda", "GPU-1"), None, True),  # it confirms the refusal
    (None, None, False),  # it does not answer: refused, but nothing confirmed it
])
def test_a_handle_naming_an_endpoint_no_transport_joins_is_checked_with_its_prefill_worker(own, pulled, reported):
    """Any caller of Decode could hand a decode worker a handle whose endpoint no transport
    joins, and the refusal became the worker's state in `baton status`. The prefill worker's
    own endpoint decides now: a forged one is pulled as the prefill worker's own says, and a
    refusal is reported only when the prefill worker confirms it."""
    fields = {name: value for name, value in vars(_Handle).items() if not name.startswith("_")}
    forged = SimpleNamespace(**{**fields, "prefill_endpoint": KvEndpoint("elsewhere", "boot-x/net:1", "cuda",
                                                                         "GPU-9")})

    async def scenario():
        receiver = _receiver(_DoneTally())
        peer = receiver._peer("prefill:1")
        peer.client = _Peers(own)
        transports = []

        async def pull(client, channel, transport, handle, block_ids, trace_metadata, first_block):
            transports.append(transport)
            return kv_receiver.ReceiveResult(True)

        receiver._pull = pull
        result = await receiver.receive(forged, [5, 6])
        return result, transports, receiver.last_refusal, peer.client.polls

    result, transports, refusal, polls = asyncio.run(scenario())
    assert polls == 1
    assert result.ok == (pulled is not None) and transports == ([pulled] if pulled else [])
    assert bool(refusal) == reported, refusal
