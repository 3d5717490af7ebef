"""The decode side of the KV handoff, mirror of prefill_worker/kv_sender.py: one lazily
opened channel per prefill worker, and the pull of one request's blocks over it
(control on gRPC through PrefillWorkerClient, data over a kvtransfer transport).

    receive(handle, blocks)
      an idle channel to that prefill worker, else a new one (up to MAX_CHANNELS_PER_PEER):
        listen() + OpenKvChannel, then accept()
      SendKv: accepted (its lease pinned, its block ids) -> recv_blocks -> done
      verify: our checksums of the blocks must equal the sender's

A channel carries one transfer at a time, so several channels per prefill worker let
pulls overlap: a burst of handoffs no longer waits in a line (each pull's RPC round
trips, its receive and its checksums), holding its decode slots and blocks meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc

from baton.runtime.clients import Metadata, PrefillWorkerClient
from baton.runtime.security import TlsConfig
from baton.wire.records import KvHandle, OpenKvChannel, SendKv, SendKvAccepted, SendKvDone
from engine.kv_cache import KVCache
from kvtransfer import KvLayoutSpec, KvTransferError, KvTransport, block_checksums, listen
from kvtransfer.wire import TAG_BITS

logger = logging.getLogger(__name__)

# Tags are per channel and wrap well inside int32 (kvtransfer derives message tags from them).
MAX_TAG = 1 << TAG_BITS  # the header carries the full tag; wire tags wrap here anyway
# Concurrent pulls from one prefill worker, each on a channel of its own (opened the
# first time that many pulls overlap).
MAX_CHANNELS_PER_PEER = 4


# Refusals of one send that leave the channel as it was: the lease is gone (NOT_FOUND),
# the request's block count disagrees (INVALID_ARGUMENT). Any other status of a SendKv
# call drops the channel.
_CHANNEL_INTACT = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


@dataclass(frozen=True, slots=True)
class ReceiveResult:
    """How one request's KV pull went."""

    ok: bool
    verified: bool = False  # every block's checksum matched the sender's
    num_bytes: int = 0
    seconds: float = 0.0
    error: str = ""  # why it failed (the caller then prefills the prompt itself)


class _Channel:
    """One channel to a prefill worker: once opened, its transport; its transfers run one
    at a time, on its own thread."""

    def __init__(self, address: str, index: int) -> None:
        self.transport: KvTransport | None = None
        self.channel_id = ""
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kv-recv-{address}-{index}")
        self.tags = itertools.count(1)

    def next_tag(self) -> int:
        return next(self.tags) % MAX_TAG

    def drop_transport(self) -> None:
        if self.transport is not None:
            self.executor.submit(self.transport.close)
            self.transport = None

    def close(self) -> None:
        self.drop_transport()
        self.executor.shutdown(wait=False)


class _Peer:
    """One prefill worker: its client and its channels, the idle ones last-used first (so
    channels beyond the first open only when pulls overlap)."""

    def __init__(self, address: str, tls: TlsConfig | None) -> None:
        self.client = PrefillWorkerClient(address, tls=tls)
        self.channels = [_Channel(address, i) for i in range(MAX_CHANNELS_PER_PEER)]
        self.idle: asyncio.LifoQueue[_Channel] = asyncio.LifoQueue()
        for channel in reversed(self.channels):
            self.idle.put_nowait(channel)


class KvReceiver:
    """Pulls handed-off KV into this worker's cache."""

    def __init__(self, worker_id: str, kv_cache: KVCache, layout: KvLayoutSpec, *, host: str, timeout_s: float,
                 verify: bool, tls: TlsConfig | None = None) -> None:
        self.worker_id = worker_id
        self.kv_cache = kv_cache
        self.layout = layout
        self.host = host
        self.timeout_s = timeout_s
        self.verify = verify
        self.tls = tls  # of the control plane's calls (OpenKvChannel, SendKv, ReleaseKv)
        self._peers: dict[str, _Peer] = {}
        # Channel ids: unique to this process (a restarted worker keeps its worker id) and
        # unguessable, since a prefill worker refuses to reopen a working channel's id.
        self._channel_prefix = f"{worker_id}-{uuid.uuid4().hex[:12]}"
        self._channel_ids = itertools.count()
        # Counters (WorkerStats).
        self.num_transfers = 0
        self.num_transfer_failures = 0
        self.num_transfers_verified = 0
        self.num_transferred_bytes = 0
        self.transfer_seconds = 0.0

    def counters(self) -> dict:
        return dict(
            num_transfers=self.num_transfers,
            num_transfer_failures=self.num_transfer_failures,
            num_transfers_verified=self.num_transfers_verified,
            num_transferred_bytes=self.num_transferred_bytes,
            transfer_seconds=self.transfer_seconds,
        )

    async def close(self) -> None:
        for peer in self._peers.values():
            for channel in peer.channels:
                channel.close()
            await peer.client.close()
        self._peers.clear()

    def client_for(self, address: str) -> PrefillWorkerClient:
        return self._peer(address).client

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = _Peer(address, self.tls)
        return peer

    async def receive(self, handle: KvHandle, block_ids: list[int], trace_metadata: Metadata = None) -> ReceiveResult:
        """Pull the KV `handle` names into `block_ids`. Never raises: a failure is reported
        (the caller then prefills the prompt itself). `trace_metadata` goes with the
        calls to the prefill worker. Cancelling it gives up the pull at once, except
        during the receive itself, which it waits for (the blocks are being written)."""
        started = time.perf_counter()
        peer = self._peer(handle.prefill_address)
        channel = await peer.idle.get()
        try:
            pulled = await self._pull(peer.client, channel, handle, block_ids, trace_metadata)
        except (KvTransferError, grpc.aio.AioRpcError, asyncio.TimeoutError, ValueError) as error:
            self.num_transfer_failures += 1
            if isinstance(error, grpc.aio.AioRpcError) and error.code() not in _CHANNEL_INTACT:
                # The peer may not know our channel any more (it restarted on its address:
                # FAILED_PRECONDITION to every send, for good). The next pull opens a new one.
                channel.drop_transport()
            message = _describe(error)
            logger.warning("KV pull of %s from %s failed: %s", handle.request_id, handle.prefill_address, message)
            return ReceiveResult(ok=False, error=message, seconds=time.perf_counter() - started)
        finally:
            peer.idle.put_nowait(channel)
        result = replace(pulled, seconds=time.perf_counter() - started)
        self.num_transfers += 1
        self.num_transfers_verified += result.verified
        self.num_transferred_bytes += result.num_bytes
        self.transfer_seconds += result.seconds
        return result

    async def _pull(self, client: PrefillWorkerClient, channel: _Channel, handle: KvHandle, block_ids: list[int],
                    trace_metadata) -> ReceiveResult:
        """The pull (its seconds left for the caller to time); raises on any failure."""
        if len(block_ids) != handle.num_blocks:
            raise ValueError(f"allocated {len(block_ids)} blocks for {handle.num_blocks} held")
        if channel.transport is None or channel.transport.is_broken:
            await self._open(client, channel, trace_metadata)
        loop = asyncio.get_running_loop()
        request = SendKv(channel.channel_id, handle.request_id, channel.next_tag(), len(block_ids), block_ids,
                         self.verify, handle.kv_token)
        call = client.send_kv(request, timeout=self.timeout_s * 2, metadata=trace_metadata)
        try:
            accepted = await call.next_event()
            if not isinstance(accepted, SendKvAccepted):
                raise ValueError("prefill worker did not accept the send")
            # NOTE: receives are posted only after the sender accepted, so a refused send
            # (lease expired, released) never leaves a receive pending on the channel.
            receiving = loop.run_in_executor(channel.executor, channel.transport.recv_blocks, self.kv_cache,
                                             block_ids, request.tag, accepted.block_ids)
            try:
                stats = await asyncio.shield(receiving)
            except asyncio.CancelledError:
                # NOTE: the receive writes into the request's blocks until it ends (the channel's
                # timeout bounds it): a pull cancelled meanwhile returns only then, so that
                # its blocks are never freed under it.
                await asyncio.wait([receiving])
                raise
            done = await call.next_event()
            if not isinstance(done, SendKvDone):
                raise ValueError("prefill worker did not confirm the send")
            if not self.verify:
                return ReceiveResult(True, num_bytes=stats.num_bytes)
            mine = await loop.run_in_executor(channel.executor, block_checksums, self.kv_cache, block_ids)
            if mine != done.block_checksums:
                bad = sum(a != b for a, b in zip(mine, done.block_checksums))
                raise KvTransferError(f"checksum mismatch in {bad} of {len(mine)} blocks")
            return ReceiveResult(True, verified=True, num_bytes=stats.num_bytes)
        except BaseException as error:
            call.cancel()
            if isinstance(error, asyncio.CancelledError):
                # The sender may have accepted and begun sending with no receive posted: its
                # send would hold the channel, and the next pull on it, until the channel's
                # timeout (30 s of held blocks on both sides). Closing our end fails that
                # send at once, and the next pull opens a new channel.
                channel.drop_transport()
            raise

    async def _open(self, client: PrefillWorkerClient, channel: _Channel, trace_metadata) -> None:
        """Offer a channel to the prefill worker and wait until it has joined."""
        channel.drop_transport()
        channel_id = f"{self._channel_prefix}-{next(self._channel_ids)}"
        offer = listen(channel_id, self.host, self.kv_cache.blocks.device, self.timeout_s)
        joining = asyncio.get_running_loop().run_in_executor(channel.executor, offer.accept)
        try:
            await client.open_kv_channel(OpenKvChannel(offer.rendezvous, self.layout, self.worker_id),
                                              timeout=self.timeout_s * 2, metadata=trace_metadata)
        except BaseException:
            # Our side of the rendezvous times out on its own; its thread is then free.
            joining.add_done_callback(lambda f: f.exception())
            raise
        channel.transport = await joining
        channel.channel_id = channel_id
        logger.info("opened KV channel %s to prefill worker %s", channel_id, client.address)


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
