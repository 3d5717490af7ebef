"""The prefill side of the KV handoff, mirror of decode_worker/kv_receiver.py: leases on
the KV held for decode workers, one channel per decode worker (joined when that worker
opens it), and the send of one request's blocks over it.

    Prefill       -> claim(): the request's kv_token owns it from now on
    Prefill done  -> hold(): the blocks stay pinned under a lease
    OpenKvChannel -> open_channel(): check the transport the decode worker chose, and
                     join the channel it hosts
    SendKv        -> send(): accepted (lease pinned) ... blocks sent ... done
                     then the blocks are freed, sent or not (the decode side re-prefills)
    ReleaseKv, or the lease expiring -> the blocks are freed unsent (a lease ends at the
                     request's deadline if that comes first: its decode call ends then too)

Only a caller that presents the request's kv_token (the gateway that prefilled it, and
the decode worker it handed the KvHandle to) may release it, abort its prefill or pull
its KV. A wrong or missing token is answered exactly as an unknown request id is
(released = false; NotHeld, NOT_FOUND): nothing is touched, and nobody can tell
whether the id exists.

Every call into the engine goes through the AsyncEngine (the engine thread), and
every transfer runs on its channel's own thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from baton.runtime.metrics import TransferTally
from baton.wire.records import KvChannelOpened, OpenKvChannel, ReleaseKv, SendKv, SendKvAccepted, SendKvDone
from engine.async_engine import AsyncEngine
from engine.errors import first_line
from engine.kv.cache import KVCache
from engine.runner.device import device_executor
from kvtransfer import (
    KvEndpoint,
    KvLayoutSpec,
    KvLeaseTable,
    KvTransferError,
    KvTransport,
    LeaseState,
    TransportRefusedError,
    block_checksums,
    check_transport,
    choose_transport,
    join,
)

logger = logging.getLogger(__name__)

LEASE_SWEEP_S = 0.25
# A lease whose request's deadline has (all but) passed still lasts this long: the table
# takes only positive leases, and the next sweep frees it.
MIN_LEASE_S = 0.001


class SendRefused(Exception):
    """A send that cannot start; nothing was sent and the lease (if any) is untouched."""


class NoChannel(SendRefused):
    """No open channel by that id (never opened, broken, or closed)."""


class NotHeld(SendRefused):
    """No KV held for the request: released, already sent, its lease expired, or the
    caller's kv_token is not its owner's."""


class AlreadySending(SendRefused):
    """Another send of the same request is running."""


class BlockCountMismatch(SendRefused):
    """The receiver allocated another number of blocks than are held."""


class AlreadyClaimed(Exception):
    """A Prefill naming a request that is being prefilled or held here already."""


class ChannelInUse(Exception):
    """An OpenKvChannel naming a channel that is open and working: refused, the open one
    kept (a decode worker opens each new channel under a new, unguessable id)."""


@dataclass
class _Channel:
    """An open channel to one decode worker; its transfers run one at a time on its thread
    (on the cache's device)."""

    transport: KvTransport
    executor: ThreadPoolExecutor
    decode_worker_id: str

    def close(self) -> None:
        self.executor.submit(self.transport.close)
        self.executor.shutdown(wait=False)


class KvSender:
    """Holds prefilled KV under leases and sends it to the decode workers that pull it."""

    def __init__(self, worker_id: str, engine: AsyncEngine, kv_cache: KVCache, layout: KvLayoutSpec,
                 endpoint: KvEndpoint, lease_s: float, tally: TransferTally) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.kv_cache = kv_cache
        self.layout = layout
        self.endpoint = endpoint  # our side, which a decode worker's transport choice must fit
        self.lease_s = lease_s
        self.tally = tally
        # Each request from its Prefill (claimed by its kv_token) until its KV is freed.
        self.leases = KvLeaseTable()
        self._channels: dict[str, _Channel] = {}
        self._sweeper: asyncio.Task | None = None
        # Counters (WorkerStats). Leases ended by their request's deadline are not counted:
        # nobody could have pulled them, however many decode workers there were.
        self.num_leases_expired = 0
        self.last_refusal = ""  # why the last OpenKvChannel was refused its transport

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_leases())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def counters(self) -> dict:
        return dict(self.tally.counters(), num_leases_expired=self.num_leases_expired,
                    kv_channel_refusal=self.last_refusal)

    # ------------------------------------------------------------------ owners
    def claim(self, request_id: str, kv_token: str) -> None:
        """A Prefill starts: `kv_token` owns the request until its lease ends, or disown().
        AlreadyClaimed if the id is being prefilled or held already."""
        try:
            self.leases.claim(request_id, kv_token)
        except ValueError as error:
            raise AlreadyClaimed(str(error)) from None

    def disown(self, request_id: str) -> None:
        """The request's Prefill ended holding nothing."""
        self.leases.disown(request_id)

    # ------------------------------------------------------------------ leases
    def hold(self, request_id: str, block_ids: list[int], num_tokens: int, deadline: float | None = None) -> float:
        """The engine holds `block_ids` for the (claimed) request: they wait under a lease
        to be pulled, for lease_s seconds or until the request's `deadline` (monotonic)
        if that comes first. The lease's length."""
        lease_s = self.lease_s
        ends_at_deadline = deadline is not None and deadline - time.monotonic() < lease_s
        if ends_at_deadline:
            lease_s = max(MIN_LEASE_S, deadline - time.monotonic())
        self.leases.hold(request_id, block_ids, num_tokens, lease_s, ends_at_deadline)
        return lease_s

    async def release(self, request: ReleaseKv) -> bool:
        """Give up a request's KV (its gateway is done with it). A request not held yet may
        still be prefilling: it is aborted there. Whether anything was released; False
        as well for a caller without the request's kv_token, and nothing is touched."""
        request_id = request.request_id
        if not self.leases.owns(request_id, request.kv_token):
            return False
        if self.leases.get(request_id).state is LeaseState.CLAIMED:
            # Still prefilling: aborted, and marked so that its Prefill, should its first
            # token be out already, frees the blocks instead of holding them for a lease.
            self.leases.release(request_id)
            return await self.engine.abort(request_id)  # its Prefill call then disowns it
        if self.leases.release(request_id):
            await self.engine.call(lambda llm: llm.release_kv(request_id))
        return True  # or it is being sent: the send frees it when done

    async def _sweep_leases(self) -> None:
        """Free KV nobody pulled in time (a decode worker that vanished, a gateway that gave up),
        and close the channels whose peer is gone (an ipc channel maps the peer's cache)."""
        while True:
            await asyncio.sleep(LEASE_SWEEP_S)
            for channel_id, channel in list(self._channels.items()):
                if channel.transport.is_broken:
                    logger.info("closed KV channel %s to decode worker %s: it is broken", channel_id,
                                channel.decode_worker_id)
                    del self._channels[channel_id]
                    channel.close()
            expired = self.leases.expired(time.monotonic())
            if not expired:
                continue
            lapsed = [lease.request_id for lease in expired if not lease.ends_at_deadline]
            if lapsed:
                self.num_leases_expired += len(lapsed)
                logger.warning("KV lease expired for %d request(s): %s", len(lapsed), lapsed[:5])
            await self.engine.call(lambda llm: [llm.release_kv(lease.request_id) for lease in expired])

    # ------------------------------------------------------------------ channels
    async def open_channel(self, request: OpenKvChannel) -> KvChannelOpened:
        """Join the channel a decode worker hosts. KvLayoutMismatchError if its cache blocks
        differ from ours; TransportRefusedError if its transport cannot join us (or is not
        the one both sides' settings give); ChannelInUse if a working channel has its id;
        KvTransferError if the rendezvous fails."""
        self.layout.check_matches(request.layout)
        rendezvous = request.rendezvous
        try:
            check_transport(rendezvous.transport, request.decode_endpoint, self.endpoint)
            expected = choose_transport(request.decode_endpoint, self.endpoint)
            if expected != rendezvous.transport:
                raise TransportRefusedError(f"the decode worker chose {rendezvous.transport}, where this prefill "
                                            f"worker's settings give {expected}")
        except TransportRefusedError as error:
            self.tally.metrics.channel_refusals.inc()
            if not self.leases.owns(request.request_id, request.kv_token):
                # Not a decode worker we handed KV to: a stranger's word is not our state.
                logger.warning("refused KV channel %s from a caller naming no request held here (%r): %s",
                               rendezvous.channel_id[:64], request.decode_worker_id[:64], first_line(error, 300))
                raise
            self.last_refusal = str(error)
            logger.error("refused KV channel %s from decode worker %s: %s", rendezvous.channel_id,
                         request.decode_worker_id, error)
            raise
        old = self._channels.get(rendezvous.channel_id)
        if old is not None and not old.transport.is_broken:
            raise ChannelInUse(f"KV channel {rendezvous.channel_id!r} is open; a new channel needs a new id")
        if old is not None:  # broken: the id may be opened again
            del self._channels[rendezvous.channel_id]
            old.close()
        executor = device_executor(self.kv_cache.blocks.device, f"kv-send-{rendezvous.channel_id}")
        cancelled = threading.Event()  # the call ended first: its thread stops waiting for the receiver
        try:
            transport = await asyncio.get_running_loop().run_in_executor(executor, join, rendezvous, self.kv_cache,
                                                                         cancelled)
        except BaseException:
            cancelled.set()
            executor.shutdown(wait=False)
            raise
        self._channels[rendezvous.channel_id] = _Channel(transport, executor, request.decode_worker_id)
        logger.info("opened KV channel %s to decode worker %s (%s)", rendezvous.channel_id,
                    request.decode_worker_id, transport.backend)
        return KvChannelOpened(self.worker_id, transport.backend)

    def backend(self, channel_id: str) -> str:
        channel = self._channels.get(channel_id)
        return channel.transport.backend if channel is not None else ""

    # ------------------------------------------------------------------ sends
    async def send(self, request: SendKv) -> AsyncIterator[SendKvAccepted | SendKvDone]:
        """Send a held request's blocks: yields accepted (the lease is pinned; only then
        may the receiver post its receives), then done. Raises a SendRefused before
        anything is sent, KvTransferError if the transfer fails. Sent or failed, the
        blocks are freed afterwards: the decode side has them, or prefills again."""
        channel = self._channels.get(request.channel_id)
        if channel is None or channel.transport.is_broken:
            raise NoChannel(f"no open KV channel {request.channel_id!r}")
        request_id = request.request_id
        lease = self.leases.get(request_id)
        if (lease is None or lease.state is LeaseState.CLAIMED
                or not self.leases.owns(request_id, request.kv_token)):
            raise NotHeld(f"no KV held for {request_id!r} (released, sent or lease expired)")
        # Checked before the lease is pinned: a malformed send must not consume it.
        num_held = len(lease.block_ids)
        first = request.first_block
        if (request.num_blocks != num_held or not 0 <= first < num_held
                or len(request.block_ids) != num_held - first):
            raise BlockCountMismatch(f"receiver allocated {request.num_blocks} blocks ({len(request.block_ids)} "
                                     f"ids given from held block {first}); {num_held} are held")
        try:
            self.leases.begin_send(request_id)
        except KeyError:
            raise NotHeld(f"no KV held for {request_id!r} (released, sent or lease expired)") from None
        except ValueError:
            raise AlreadySending(f"KV of {request_id!r} is already being sent") from None
        block_ids = list(lease.block_ids[first:])  # the receiver's prefix cache holds the rest
        transport = channel.transport
        try:
            yield SendKvAccepted(block_ids)
            loop = asyncio.get_running_loop()
            try:
                stats = await loop.run_in_executor(channel.executor, transport.send_blocks,
                                                   self.kv_cache, block_ids, request.tag, request.block_ids)
                checksums = []
                if request.verify:  # the receiver compares them with its own
                    checksums = await loop.run_in_executor(channel.executor, block_checksums, self.kv_cache,
                                                           block_ids)
            # ValueError: ids out of the peer's range; RuntimeError: the channel was closed under us.
            except (KvTransferError, ValueError, RuntimeError) as error:
                self.tally.failed(transport.backend)
                logger.warning("KV send of %s failed: %s", request_id, error)
                raise KvTransferError(str(error)) if not isinstance(error, KvTransferError) else error
            self.tally.done(transport.backend, stats.num_bytes, stats.seconds)
            yield SendKvDone(checksums, stats.num_bytes, stats.seconds)
        finally:
            self.leases.end_send(request_id)
            await self.engine.call(lambda llm: llm.release_kv(request_id))
