"""The decode side of the KV handoff, mirror of prefill_worker/kv_sender.py: one lazily
opened channel per prefill worker, and the pull of one request's blocks over it
(control on gRPC through PrefillWorkerClient, data over a kvtransfer transport).

    receive(handle, blocks)
      the transport: chosen from our endpoint and the handle's (kvtransfer.endpoint),
        or refused, and the prompt is prefilled here
      an idle channel to that prefill worker, else a new one (up to MAX_CHANNELS_PER_PEER):
        listen() + OpenKvChannel, then accept()
      SendKv: accepted (its lease pinned, its block ids) -> recv_blocks -> done
      verify: our checksums of the blocks must equal the sender's

A receive that fails while the sender may still be writing into its blocks (an ipc
sender that stopped answering mid-copy) says so (`ReceiveResult.settled`): the caller
keeps those blocks out of use until the sender is known to write no more.

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
from dataclasses import dataclass, field, replace

import grpc
import torch

from baton.runtime import latency
from baton.runtime.clients import Metadata, PrefillWorkerClient
from baton.runtime.metrics import TransferTally
from baton.runtime.security import TlsConfig
from baton.wire.records import KvHandle, OpenKvChannel, SendKv, SendKvAccepted, SendKvDone
from engine.kv.cache import KVCache
from engine.runner.device import device_executor
from kvtransfer import (
    KvEndpoint,
    KvLayoutSpec,
    KvTransferError,
    KvTransport,
    TransportRefusedError,
    block_checksums,
    choose_transport,
    listen,
)
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
# How often a transfer in doubt is asked whether it has settled (see ReceiveResult.settled).
SETTLE_POLL_S = 1.0
# Why a handed-off prompt is prefilled here when no prefill worker is listed.
UNLISTED = ("this decode worker pulls KV from no prefill worker (--allowed-prefill-workers unset); it prefills "
            "handed-off prompts itself")


@dataclass(frozen=True, slots=True)
class ReceiveResult:
    """How one request's KV pull went."""

    ok: bool
    transport: str = ""  # the channel's ("" when none could be had)
    verified: bool = False  # every block's checksum matched the sender's
    num_bytes: int = 0
    seconds: float = 0.0
    error: str = ""  # why it failed (the caller then prefills the prompt itself)
    # Its moments (baton/runtime/latency.py) as time.monotonic() readings: started, had a
    # channel, had the blocks, ended (the checksums compared and the send confirmed).
    moments: dict[str, float] = field(default_factory=dict)
    # Failed, and the sender may still be writing into the blocks: done once it no longer
    # can (it answered, or is gone). Until then the blocks must stay out of use.
    settled: asyncio.Future | None = None


class _Channel:
    """One channel to a prefill worker: once opened, its transport; its transfers run one
    at a time, on its own thread (on `device`, the cache's)."""

    def __init__(self, address: str, index: int, device: torch.device) -> None:
        self.transport: KvTransport | None = None
        self.channel_id = ""
        self.executor = device_executor(device, f"kv-recv-{address}-{index}")
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

    def __init__(self, address: str, tls: TlsConfig | None, device: torch.device) -> None:
        self.client = PrefillWorkerClient(address, tls=tls)
        self.refusals_logged: set[str] = set()  # refusals logged as errors (once each)
        self.ever_opened = False  # a channel to it opened once: it was reachable
        self.channels = [_Channel(address, i, device) for i in range(MAX_CHANNELS_PER_PEER)]
        self.idle: asyncio.LifoQueue[_Channel] = asyncio.LifoQueue()
        for channel in reversed(self.channels):
            self.idle.put_nowait(channel)


class KvReceiver:
    """Pulls handed-off KV into this worker's cache."""

    def __init__(self, worker_id: str, kv_cache: KVCache, layout: KvLayoutSpec, endpoint: KvEndpoint, *, host: str,
                 timeout_s: float, verify: bool, tally: TransferTally, tls: TlsConfig | None = None,
                 ports: tuple[int, int] | None = None) -> None:
        self.worker_id = worker_id
        self.kv_cache = kv_cache
        self.device = kv_cache.blocks.device  # every thread that works on the cache makes it current
        self.layout = layout
        self.endpoint = endpoint  # our side of every channel
        self.host = host  # of the rendezvous store (gloo, nccl)
        self.ports = ports  # the store's port range (--kv-ports); None: any free port
        self.timeout_s = timeout_s
        self.verify = verify
        self.tls = tls  # of the control plane's calls (OpenKvChannel, SendKv, ReleaseKv)
        self._peers: dict[str, _Peer] = {}
        # Channel ids: unique to this process (a restarted worker keeps its worker id) and
        # unguessable, since a prefill worker refuses to reopen a working channel's id.
        self._channel_prefix = f"{worker_id}-{uuid.uuid4().hex[:12]}"
        self._channel_ids = itertools.count()
        self._settling: set[asyncio.Task] = set()  # transports of transfers in doubt, until settled
        self._closing = False
        self.tally = tally
        self.last_refusal = ""  # why the last channel was refused its transport

    def counters(self) -> dict:
        return dict(self.tally.counters(), kv_channel_refusal=self.last_refusal)

    async def close(self) -> None:
        self._closing = True
        for task in self._settling:
            task.cancel()
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
            peer = self._peers[address] = _Peer(address, self.tls, self.device)
        return peer

    async def receive(self, handle: KvHandle, block_ids: list[int], trace_metadata: Metadata = None,
                      first_block: int = 0) -> ReceiveResult:
        """Pull the KV `handle` names into `block_ids`; with `first_block`, only that of held
        blocks first_block.. (this worker's prefix cache holds the blocks before). Never
        raises: a failure is reported (the caller then prefills the prompt itself).
        `trace_metadata` goes with the calls to the prefill worker. Cancelling it gives up
        the pull at once, except during the receive itself, which it waits for (the blocks
        are being written)."""
        started, started_at = time.perf_counter(), time.monotonic()
        if not handle.prefill_address:  # a peer we were told of none of (DecodeWorker._check_prefill_worker)
            self.last_refusal = UNLISTED
            self.tally.failed("")
            return ReceiveResult(ok=False, error=f"refused: {UNLISTED}", seconds=time.perf_counter() - started)
        peer = self._peer(handle.prefill_address)
        try:
            if handle.prefill_endpoint is None:
                raise TransportRefusedError("the KV handle does not say where its KV lives")
            transport = choose_transport(self.endpoint, handle.prefill_endpoint)
        except TransportRefusedError as error:
            transport = await self._confirm_refusal(peer, handle, error)
            if transport is None:
                self.tally.failed("")
                return ReceiveResult(ok=False, error=f"refused: {error}", seconds=time.perf_counter() - started)
        channel = await peer.idle.get()
        try:
            pulled = await self._pull(peer.client, channel, transport, handle, block_ids, trace_metadata,
                                      first_block)
        except Exception as error:  # noqa: BLE001 - any failure is reported; the prompt is prefilled here
            self.tally.failed(transport)
            settled = None
            if isinstance(error, TransportRefusedError):
                self._refused(peer, handle.prefill_address, error)
            elif isinstance(error, KvTransferError) and error.in_doubt:
                settled = self._settle(channel, handle)
            elif isinstance(error, grpc.aio.AioRpcError) and error.code() not in _CHANNEL_INTACT:
                # The peer may not know our channel any more (it restarted on its address:
                # FAILED_PRECONDITION to every send, for good). The next pull opens a new one.
                channel.drop_transport()
            elif not isinstance(error, (KvTransferError, grpc.aio.AioRpcError, asyncio.TimeoutError, ValueError)):
                channel.drop_transport()  # unforeseen (a socket or thread we could not have): start afresh
            message = _describe(error)
            if (isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
                    and not peer.ever_opened):  # one that worked before is lost, not misconfigured
                self._unreachable(peer, handle.prefill_address, transport, message)
            logger.warning("KV pull of %s from %s over %s failed: %s", handle.request_id, handle.prefill_address,
                           transport, message)
            return ReceiveResult(ok=False, transport=transport, error=message, settled=settled,
                                 seconds=time.perf_counter() - started)
        except asyncio.CancelledError:
            self.tally.failed(transport)
            raise
        finally:
            peer.idle.put_nowait(channel)
        moments = {latency.RECEIVE_STARTED: started_at, **pulled.moments, latency.KV_RECEIVED: time.monotonic()}
        result = replace(pulled, transport=transport, seconds=time.perf_counter() - started, moments=moments)
        self.tally.done(transport, result.num_bytes, result.seconds, result.verified)
        return result

    async def _confirm_refusal(self, peer: _Peer, handle: KvHandle, error: TransportRefusedError) -> str | None:
        """A handle whose endpoint no transport joins to ours: the caller's word, which a
        stranger's Decode could forge. The prefill worker's own endpoint (its GetStats)
        decides: the transport to it if one joins (the handle lied: logged), else None,
        the refusal reported as this worker's state only if the prefill worker confirms it."""
        try:
            stats = await peer.client.get_stats(timeout=min(5.0, self.timeout_s))
        except grpc.aio.AioRpcError as rpc_error:
            logger.warning("a KV handle for %s names an endpoint no transport joins to ours (%s), and prefill "
                           "worker %s does not answer to confirm it: %s", handle.request_id[:64], error,
                           handle.prefill_address, _describe(rpc_error))
            return None
        try:
            if stats.kv_endpoint is None:
                raise TransportRefusedError("the prefill worker does not say where its KV lives")
            transport = choose_transport(self.endpoint, stats.kv_endpoint)
        except TransportRefusedError as confirmed:
            self._refused(peer, handle.prefill_address, confirmed)
            return None
        logger.warning("a KV handle for %s named an endpoint of prefill worker %s that is not its own (%s); pulled "
                       "over %s by its own", handle.request_id[:64], handle.prefill_address, error, transport)
        return transport

    def _refused(self, peer: _Peer, address: str, error: TransportRefusedError) -> None:
        """A pair no transport can join: the request is prefilled here. Loud once per reason."""
        self.tally.metrics.channel_refusals.inc()
        self._report_once(peer, str(error), f"no KV channel to prefill worker {address}: {error}; its requests are "
                                            "prefilled here")

    def _report_once(self, peer: _Peer, reason: str, message: str, key: str | None = None) -> None:
        """`reason` becomes this worker's kv_channel_refusal (a `baton status` finding);
        `message` is logged as an ERROR the first time `peer` gives that `key` (the reason
        unless given), later as DEBUG."""
        self.last_refusal = reason
        key = reason if key is None else key
        level = logging.DEBUG if key in peer.refusals_logged else logging.ERROR
        peer.refusals_logged.add(key)
        logger.log(level, "%s", message)

    def _unreachable(self, peer: _Peer, address: str, transport: str, message: str) -> None:
        """The two workers could not reach each other: the prefill worker's advertised address
        from here (gRPC), or our KV rendezvous from there (it says so). Loud once per peer:
        across hosts it is a deployment's error (an address advertised that peers cannot
        reach, a port a firewall closes), and every handoff from there will fail alike."""
        self._report_once(
            peer, f"prefill worker {address} and this decode worker cannot reach each other: {message}",
            f"prefill worker {address} and this decode worker cannot reach each other over {transport} ({message}): "
            "check the address it advertises (--advertise), ours (--advertise, --transfer-host), --kv-ports and "
            "the network between; its requests are prefilled here", key=address)

    def _settle(self, channel: _Channel, handle: KvHandle) -> asyncio.Future:
        """Take a transport whose last receive failed in doubt off its channel (the next pull
        there opens a new one); the returned future is done once it has settled."""
        transport, channel.transport = channel.transport, None
        loop = asyncio.get_running_loop()
        settled = loop.create_future()
        # A thread of its own: the channel's next pull must not queue behind the waits.
        executor = device_executor(self.device, f"kv-settle-{channel.channel_id}")
        logger.warning("KV pull of %s from %s failed with the sender perhaps still writing: its %d blocks stay "
                       "out of use until the sender answers or exits", handle.request_id, handle.prefill_address,
                       handle.num_blocks)

        async def wait() -> None:
            try:
                while not self._closing:
                    if await loop.run_in_executor(executor, transport.wait_settled, SETTLE_POLL_S):
                        settled.set_result(None)
                        return
            finally:
                if not settled.done():  # shutting down: the fence is never lifted, the process ends
                    settled.cancel()
                try:
                    await loop.run_in_executor(executor, transport.close)
                finally:
                    executor.shutdown(wait=False)

        task = asyncio.create_task(wait())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return settled

    async def _pull(self, client: PrefillWorkerClient, channel: _Channel, transport: str, handle: KvHandle,
                    block_ids: list[int], trace_metadata, first_block: int = 0) -> ReceiveResult:
        """The pull (its seconds left for the caller to time); raises on any failure."""
        if not block_ids or len(block_ids) != handle.num_blocks - first_block:
            raise ValueError(f"{len(block_ids)} blocks to receive from held block {first_block}; "
                             f"{handle.num_blocks} are held")
        current = channel.transport
        if current is None or current.is_broken or current.backend != transport:
            await self._open(client, channel, transport, handle, trace_metadata)
        channel_ready_at = time.monotonic()
        loop = asyncio.get_running_loop()
        request = SendKv(channel.channel_id, handle.request_id, channel.next_tag(), first_block + len(block_ids),
                         block_ids, self.verify, handle.kv_token, first_block)
        call = client.send_kv(request, timeout=self.timeout_s * 2, metadata=trace_metadata)
        try:
            accepted = await call.next_event()
            if not isinstance(accepted, SendKvAccepted):
                raise ValueError("prefill worker did not accept the send")
            # NOTE: receives are posted only after the sender accepted, so a refused send
            # (lease expired, released) never leaves a receive pending on the channel.
            receiving = loop.run_in_executor(channel.executor, channel.transport.recv_blocks, self.kv_cache,
                                             block_ids, request.tag, accepted.block_ids)
            # NOTE: the receive writes into the request's blocks until it ends (the channel's
            # timeout bounds it): a pull cancelled meanwhile (once or more) returns only then,
            # so that its blocks are never freed under it. A receive that ended in doubt says
            # so instead: its blocks must outlive even that.
            cancelled = False
            while not receiving.done():
                try:
                    await asyncio.shield(receiving)
                except asyncio.CancelledError:
                    cancelled = True
                except Exception:  # noqa: BLE001 - read from the future below
                    pass
            failure = None if receiving.cancelled() else receiving.exception()
            if cancelled:
                if isinstance(failure, KvTransferError) and failure.in_doubt:
                    raise failure from None
                raise asyncio.CancelledError
            stats = receiving.result()
            moments = {latency.CHANNEL_READY: channel_ready_at, latency.COPIED: time.monotonic()}
            done = await call.next_event()
            if not isinstance(done, SendKvDone):
                raise ValueError("prefill worker did not confirm the send")
            if not self.verify:
                return ReceiveResult(True, num_bytes=stats.num_bytes, moments=moments)
            mine = await loop.run_in_executor(channel.executor, block_checksums, self.kv_cache, block_ids)
            if mine != done.block_checksums:
                bad = sum(a != b for a, b in zip(mine, done.block_checksums))
                raise KvTransferError(f"checksum mismatch in {bad} of {len(mine)} blocks")
            return ReceiveResult(True, verified=True, num_bytes=stats.num_bytes, moments=moments)
        except BaseException as error:
            call.cancel()
            if isinstance(error, asyncio.CancelledError):
                # The sender may have accepted and begun sending with no receive posted: its
                # send would hold the channel, and the next pull on it, until the channel's
                # timeout (30 s of held blocks on both sides). Closing our end fails that
                # send at once, and the next pull opens a new channel.
                channel.drop_transport()
            raise

    async def _open(self, client: PrefillWorkerClient, channel: _Channel, transport: str, handle: KvHandle,
                    trace_metadata) -> None:
        """Offer a channel of `transport` to the prefill worker, for the pull of `handle`
        (whose request and token tell it we are a peer it handed KV to), and wait until it
        has joined. TransportRefusedError if the prefill worker refuses it (FAILED_PRECONDITION)."""
        channel.drop_transport()
        channel_id = f"{self._channel_prefix}-{next(self._channel_ids)}"
        offer = listen(channel_id, transport, self.host, self.kv_cache, self.timeout_s, self.ports)
        joining = asyncio.get_running_loop().run_in_executor(channel.executor, offer.accept)
        try:
            opening = OpenKvChannel(offer.rendezvous, self.layout, self.worker_id, self.endpoint, handle.request_id,
                                    handle.kv_token)
            await client.open_kv_channel(opening, timeout=self.timeout_s * 2, metadata=trace_metadata)
        except BaseException as error:
            # Our side gives up now where it can (ipc), else times out on its own; either way
            # the channel's thread is then free for the next open.
            offer.cancel()
            joining.add_done_callback(lambda f: f.cancelled() or f.exception())
            if isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise TransportRefusedError(f"the prefill worker refused the channel: {error.details()}") from None
            raise
        channel.transport = await joining
        channel.channel_id = channel_id
        peer = self._peers.get(client.address)
        if peer is not None:
            peer.ever_opened = True
        logger.info("opened KV channel %s to prefill worker %s over %s", channel_id, client.address, transport)


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
