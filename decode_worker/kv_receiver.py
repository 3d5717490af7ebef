"""The decode side of the KV handoff: one lazily opened channel per prefill worker, and
the pull of one request's blocks over it (control on gRPC, data on torch.distributed)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from baton.wire.internal.v1 import worker_pb2, worker_pb2_grpc
from baton.runtime.server import CHANNEL_OPTIONS
from baton.runtime.worker import layout_to_pb
from engine.kv_cache import KVCache
from kvtransfer import KvChannel, KvLayoutSpec, KvTransferError, block_checksums
from kvtransfer.wire import TAG_BITS

logger = logging.getLogger(__name__)

# Tags are per channel and wrap well inside int32 (kvtransfer derives message tags from them).
MAX_TAG = 1 << TAG_BITS  # the header carries the full tag; wire tags wrap here anyway


@dataclass(frozen=True, slots=True)
class ReceiveResult:
    """How one request's KV pull went."""

    ok: bool
    verified: bool = False
    num_bytes: int = 0
    seconds: float = 0.0
    error: str = ""


class _Peer:
    """One prefill worker: its gRPC stub and, once opened, the KV channel to it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.grpc_channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.PrefillWorkerStub(self.grpc_channel)
        self.channel: KvChannel | None = None
        self.channel_id = ""
        # Transfers on one channel run one at a time, on this thread, in arrival order.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kv-recv-{address}")
        self.lock = asyncio.Lock()
        self.tags = itertools.count(1)

    def next_tag(self) -> int:
        return next(self.tags) % MAX_TAG


class KvReceiver:
    """Pulls handed-off KV into this worker's cache."""

    def __init__(
        self,
        worker_id: str,
        kv_cache: KVCache,
        layout: KvLayoutSpec,
        *,
        host: str,
        timeout_s: float,
        verify: bool,
    ) -> None:
        self.worker_id = worker_id
        self.kv_cache = kv_cache
        self.layout = layout
        self.host = host
        self.timeout_s = timeout_s
        self.verify = verify
        self._peers: dict[str, _Peer] = {}
        self._channel_ids = itertools.count()
        # Counters.
        self.num_transfers = 0
        self.num_transfer_failures = 0
        self.num_transfers_verified = 0
        self.num_transferred_bytes = 0
        self.transfer_seconds = 0.0

    async def close(self) -> None:
        for peer in self._peers.values():
            if peer.channel is not None:
                peer.executor.submit(peer.channel.close)
            peer.executor.shutdown(wait=False)
            await peer.grpc_channel.close()
        self._peers.clear()

    def stub_for(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return self._peer(address).stub

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = _Peer(address)
        return peer

    async def receive(
        self, handle: worker_pb2.KvHandle, block_ids: list[int], trace_metadata=None
    ) -> ReceiveResult:
        """Pull the KV `handle` names into `block_ids`. Never raises: a failure is reported
        (the caller then prefills the prompt itself). `trace_metadata` goes with the
        calls to the prefill worker."""
        started = time.perf_counter()
        peer = self._peer(handle.prefill_address)
        try:
            async with peer.lock:
                result = await self._pull(peer, handle, block_ids, trace_metadata)
        except (KvTransferError, grpc.aio.AioRpcError, asyncio.TimeoutError, ValueError) as error:
            self.num_transfer_failures += 1
            message = _describe(error)
            logger.warning("KV pull of %s from %s failed: %s", handle.request_id,
                           handle.prefill_address, message)
            return ReceiveResult(ok=False, error=message, seconds=time.perf_counter() - started)
        self.num_transfers += 1
        self.num_transfers_verified += result.verified
        self.num_transferred_bytes += result.num_bytes
        seconds = time.perf_counter() - started
        self.transfer_seconds += seconds
        return ReceiveResult(True, result.verified, result.num_bytes, seconds)

    async def _pull(
        self, peer: _Peer, handle: worker_pb2.KvHandle, block_ids: list[int], trace_metadata
    ) -> ReceiveResult:
        if len(block_ids) != handle.num_blocks:
            raise ValueError(f"allocated {len(block_ids)} blocks for {handle.num_blocks} held")
        if peer.channel is None or peer.channel.is_broken:
            await self._open(peer, trace_metadata)
        loop = asyncio.get_running_loop()
        tag = peer.next_tag()
        call = peer.stub.SendKv(
            worker_pb2.SendKvRequest(
                channel_id=peer.channel_id,
                request_id=handle.request_id,
                tag=tag,
                num_blocks=len(block_ids),
                verify=self.verify,
                block_ids=block_ids,
            ),
            timeout=self.timeout_s * 2,
            metadata=trace_metadata,
        )
        try:
            accepted = await call.read()
            if accepted is grpc.aio.EOF or not accepted.HasField("accepted"):
                raise ValueError("prefill worker did not accept the send")
            # NOTE: receives are posted only after the sender accepted, so a refused send
            # (lease expired, released) never leaves a receive pending on the channel.
            src_block_ids = list(accepted.accepted.block_ids)
            stats = await loop.run_in_executor(
                peer.executor, peer.channel.recv_blocks, self.kv_cache, block_ids, tag, src_block_ids
            )
            done = await call.read()
            if done is grpc.aio.EOF or not done.HasField("done"):
                raise ValueError("prefill worker did not confirm the send")
            verified = False
            if self.verify:
                mine = await loop.run_in_executor(peer.executor, block_checksums, self.kv_cache, block_ids)
                theirs = list(done.done.block_checksums)
                mine = [c & 0xFFFF_FFFF_FFFF_FFFF for c in mine]
                if mine != theirs:
                    bad = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
                    raise KvTransferError(f"checksum mismatch in {len(bad)} of {len(mine)} blocks")
                verified = True
        except BaseException:
            call.cancel()
            raise
        return ReceiveResult(True, verified, stats.num_bytes, stats.seconds)

    async def _open(self, peer: _Peer, trace_metadata=None) -> None:
        """Rendezvous a two-rank group with the prefill worker: we host the store (rank 1)."""
        if peer.channel is not None:
            peer.executor.submit(peer.channel.close)
            peer.channel = None
        store = KvChannel.host_store(self.host)
        channel_id = f"{self.worker_id}-{next(self._channel_ids)}"
        loop = asyncio.get_running_loop()
        device = self.kv_cache.blocks.device
        joining = loop.run_in_executor(
            peer.executor,
            lambda: KvChannel.connect(
                channel_id=channel_id,
                host=self.host,
                port=store.port,
                rank=1,
                device=device,
                timeout_s=self.timeout_s,
                store=store,
            ),
        )
        try:
            await peer.stub.OpenKvChannel(
                worker_pb2.OpenKvChannelRequest(
                    channel_id=channel_id,
                    store_host=self.host,
                    store_port=store.port,
                    layout=layout_to_pb(self.layout),
                    decode_worker_id=self.worker_id,
                    timeout_seconds=self.timeout_s,
                ),
                timeout=self.timeout_s * 2,
                metadata=trace_metadata,
            )
        except BaseException:
            # Our side of the rendezvous times out on its own; its thread is then free.
            joining.add_done_callback(lambda f: f.exception())
            raise
        peer.channel = await joining
        peer.channel_id = channel_id
        logger.info("opened KV channel %s to prefill worker %s", channel_id, peer.address)


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
