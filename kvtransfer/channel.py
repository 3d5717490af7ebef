"""KvChannel: moves a request's KV blocks from a prefill process's cache (rank 0, the
sender) into a decode process's cache (rank 1, the receiver) over a two-rank
torch.distributed group. Messages and tags: wire.py. The group: group.py.

Pipeline (num_slots staging slots of message_bytes on each side): the sender gathers
message i (index_select of each layer's blocks) into a slot while earlier messages
are on the wire; the receiver keeps num_slots - 1 receives posted and scatters
(index_copy_) each message into its cache while the next one arrives. Sender
block_ids[i] lands in receiver block_ids[i].
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.kv_cache import KVCache
from kvtransfer.group import StoreServer, abort_group, join_group
from kvtransfer.layout import KvLayoutSpec
from kvtransfer.wire import HEADER_CAPACITY, HEADER_LEN, TransferHeader, plan_messages, wire_tag

# Pipeline shape, measured with kvtransfer/bench.py over loopback Gloo on 2 cores
# (SmolLM2 blocks; 1, 2, 4 and 8 MB messages, 2 to 4 slots): 4 MB messages amortise
# the per-message round trip; 2 slots (one message in flight while the other is
# gathered or scattered) beat deeper pipelines, whose extra posts contend for
# Gloo's pair lock and whose threads contend for the cores.
DEFAULT_MESSAGE_BYTES = 4 << 20
DEFAULT_NUM_SLOTS = 2


class KvTransferError(RuntimeError):
    """A rendezvous or transfer failed or timed out. The channel is then broken: close
    it and connect a new one (under a new channel id)."""


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one transfer (or raw send/recv) moved, and how long it took on this side."""

    num_blocks: int
    num_bytes: int
    seconds: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.num_bytes / self.seconds if self.seconds > 0 else float("inf")


class KvChannel:
    """One (prefill, decode) pair's two-rank group: rank 0 sends KV blocks, rank 1 receives.

    Every call blocks its thread until done or failed; any thread may call (one
    single-thread executor per channel is the intended use). Calls are serialized by
    a lock, so the messages of two transfers never interleave. Any failure (timeout,
    peer gone, header mismatch) raises KvTransferError and breaks the channel for good.
    """

    def __init__(
        self,
        *,
        channel_id: str,
        group: dist.ProcessGroup,
        store: dist.Store,
        store_server: StoreServer | None,
        rank: int,
        device: torch.device,
        timeout_s: float,
        message_bytes: int,
        num_slots: int,
    ) -> None:
        self.channel_id = channel_id
        self.rank = rank
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout_s = timeout_s
        self.message_bytes = message_bytes
        self.num_slots = num_slots
        self._group: dist.ProcessGroup | None = group
        self._store = store  # holds the group's rendezvous keys
        self._store_server = store_server
        self._lock = threading.Lock()
        self._broken_reason: str | None = None
        # Reused by every transfer: fresh staging memory would page-fault each time and
        # start cold in the caches.
        self._staging: torch.Tensor | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ------------------------------------------------------------ lifecycle

    @staticmethod
    def host_store(host: str = "127.0.0.1", port: int = 0) -> StoreServer:
        """Start the rendezvous store (receiver side); its host and port go to the sender."""
        return StoreServer(host, port)

    @classmethod
    def connect(
        cls,
        *,
        channel_id: str,
        host: str,
        port: int,
        rank: int,
        device: torch.device | str,
        timeout_s: float,
        store: StoreServer | None = None,
        message_bytes: int = DEFAULT_MESSAGE_BYTES,
        num_slots: int = DEFAULT_NUM_SLOTS,
    ) -> KvChannel:
        """Join the two-rank group at host:port; returns once the peer has joined too.

        Rank 1 (receiver) passes the StoreServer it hosts; the channel keeps it alive
        and drops it on close(). `channel_id` must be new on that store for every
        connect (an old channel's rendezvous keys stay there). `timeout_s` bounds the
        rendezvous and, later, every wait for a message. Gloo for a CPU device, NCCL
        for CUDA. Raises KvTransferError if the peer does not join in time.
        """
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 (sender) or 1 (receiver), got {rank}")
        if message_bytes <= 0 or num_slots < 2:
            raise ValueError("message_bytes must be positive and num_slots at least 2")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        try:
            group, prefixed = join_group(channel_id, host, port, rank, device, timeout_s,
                                         agree={"message_bytes": str(message_bytes)})
        except ValueError as error:  # joined, but the two sides are set up differently
            raise KvTransferError(f"channel {channel_id}: {error}") from error
        except (RuntimeError, OSError) as error:  # DistStoreError, DistNetworkError, refused, unresolvable
            raise KvTransferError(
                f"channel {channel_id}: peer did not join within {timeout_s:g} s: {_first_line(error)}"
            ) from error
        return cls(channel_id=channel_id, group=group, store=prefixed, store_server=store, rank=rank,
                   device=device, timeout_s=timeout_s, message_bytes=message_bytes, num_slots=num_slots)

    @property
    def is_broken(self) -> bool:
        """True once a transfer failed or the channel was closed; it is never usable again."""
        return self._broken_reason is not None

    def close(self) -> None:
        """Release the group, the store and the staging memory; idempotent, any thread.

        Never waits for the peer (it may be gone); the peer's pending messages fail at
        once ("connection closed"). A transfer running in another thread holds the lock
        until it ends (at the latest when its current wait times out); close waits for it.
        """
        if self._broken_reason is None:
            self._broken_reason = "closed"
        with self._lock:
            self._release()

    # ------------------------------------------------------------ transfers

    def send_blocks(self, kv_cache: KVCache, block_ids: Sequence[int], tag: int) -> TransferStats:
        """Send `block_ids` of every layer (K and V) under transfer `tag`; rank 0 only.

        Returns once every message has left this process.
        """
        if self.rank != 0:
            raise ValueError("send_blocks is for rank 0, the prefill side")
        spec, index, plan = self._prepare(kv_cache, block_ids, tag)
        with self._lock, self._scope():
            self._check_usable()
            started = time.perf_counter()
            works = []  # every send, header first; only here (see _fail)
            try:
                header = TransferHeader(spec, len(index), tag).encode().to(self._comm_device)
                works.append(self._group.send([header], 1, wire_tag(tag, 0)))
                layers = [(_rows(keys), _rows(values)) for keys, values in kv_cache.layers]
                slots = self._staging_slots()
                # NOTE: wait each Gloo send exactly once: a second wait waits for a second
                # completion, which never comes.
                # Per slot: the index in works of the send still reading it.
                in_flight: list[int | None] = [None] * self.num_slots
                for i, message in enumerate(plan):
                    slot = i % self.num_slots
                    if in_flight[slot] is not None:
                        self._wait(works[in_flight[slot]])
                    # [layers, K/V, blocks, row]
                    buffer = _typed(slots[slot], spec, message.numel(spec)).view(message.shape(spec))
                    positions = index[message.block_start : message.block_stop]
                    for j, layer in enumerate(range(message.layer_start, message.layer_stop)):
                        keys, values = layers[layer]  # [num_blocks, row]
                        torch.index_select(keys, 0, positions, out=buffer[j, 0])
                        torch.index_select(values, 0, positions, out=buffer[j, 1])
                    works.append(self._group.send([buffer.view(-1)], 1, wire_tag(tag, i + 1)))
                    in_flight[slot] = len(works) - 1
                for k in [0, *in_flight]:
                    if k is not None:
                        self._wait(works[k])
            except Exception as error:
                raise self._fail(error, works) from error
        return TransferStats(len(index), len(index) * spec.bytes_per_block, time.perf_counter() - started)

    def recv_blocks(self, kv_cache: KVCache, block_ids: Sequence[int], tag: int) -> TransferStats:
        """Receive transfer `tag` into `block_ids` of every layer (K and V); rank 1 only.

        Returns once the blocks are in the cache. The sender's header is checked
        before any data reaches the cache: a different layout, block count or tag
        raises KvTransferError (chained to the KvLayoutMismatchError / ValueError
        saying which). Blocks not in `block_ids` are never written.
        """
        if self.rank != 1:
            raise ValueError("recv_blocks is for rank 1, the decode side")
        spec, index, plan = self._prepare(kv_cache, block_ids, tag, unique=True)
        with self._lock, self._scope():
            self._check_usable()
            started = time.perf_counter()
            works = []  # the header's receive, then message i's at works[1 + i]; only here (see _fail)
            try:
                slots = self._staging_slots()
                # Gloo takes a message smaller than the receive posted for it, so whole-slot
                # receives go out before the header is checked (see the NOTE in wire.py) and
                # its round trip overlaps the first message. NCCL wants sizes that match:
                # there the header is checked first.
                gloo = self.backend == "gloo"

                def post(i: int) -> None:
                    slot = slots[i % self.num_slots]
                    buffer = slot if gloo else _typed(slot, spec, plan[i].numel(spec))
                    works.append(self._group.recv([buffer], 0, wire_tag(tag, i + 1)))

                header = torch.empty(HEADER_CAPACITY if gloo else HEADER_LEN, dtype=torch.int64,
                                     device=self._comm_device)
                works.append(self._group.recv([header], 0, wire_tag(tag, 0)))
                ahead = self.num_slots - 1  # one slot is scattered while the others receive
                if gloo:
                    for i in range(min(ahead, len(plan))):
                        post(i)
                self._wait(works[0])
                theirs = TransferHeader.decode(header)
                spec.check_matches(theirs.spec)
                if theirs.tag != tag or theirs.num_blocks != len(index):
                    raise ValueError(f"sender sends transfer {theirs.tag} of {theirs.num_blocks} blocks, "
                                     f"receiver expects transfer {tag} of {len(index)}")
                if not gloo:
                    for i in range(min(ahead, len(plan))):
                        post(i)
                layers = [(_wide(_rows(keys)), _wide(_rows(values))) for keys, values in kv_cache.layers]
                for i, message in enumerate(plan):
                    self._wait(works[1 + i])
                    if i + ahead < len(plan):
                        # NOTE: post as soon as a message lands, while the socket is idle:
                        # posting during a read waits on Gloo's pair lock for the whole read.
                        post(i + ahead)
                    buffer = _typed(slots[i % self.num_slots], spec, message.numel(spec))
                    buffer = buffer.view(message.shape(spec))  # [layers, K/V, blocks, row]
                    positions = index[message.block_start : message.block_stop]
                    for j, layer in enumerate(range(message.layer_start, message.layer_stop)):
                        keys, values = layers[layer]  # [num_blocks, row], wide view
                        keys.index_copy_(0, positions, _wide(buffer[j, 0]))
                        values.index_copy_(0, positions, _wide(buffer[j, 1]))
                if self._stream is not None:
                    self._stream.synchronize()  # in the cache before we say so
            except Exception as error:
                raise self._fail(error, works) from error
        return TransferStats(len(index), len(index) * spec.bytes_per_block, time.perf_counter() - started)

    def raw_send(self, tensor: torch.Tensor, tag: int) -> TransferStats:
        """One plain send of a contiguous tensor (a bandwidth baseline, or a small signal).

        Raw messages share the tag space with transfers: use tags no transfer uses."""
        return self._raw(tensor, tag, send=True)

    def raw_recv(self, tensor: torch.Tensor, tag: int) -> TransferStats:
        """One plain receive into a contiguous tensor of the size sent."""
        return self._raw(tensor, tag, send=False)

    # ------------------------------------------------------------ internals

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _scope(self) -> contextlib.AbstractContextManager:
        """CUDA: this channel's device and side stream for the calling thread."""
        if self._stream is None:
            return contextlib.nullcontext()
        scope = contextlib.ExitStack()
        scope.enter_context(torch.cuda.device(self.device))
        # The blocks to send were written on the default stream: order after it.
        self._stream.wait_stream(torch.cuda.default_stream(self.device))
        scope.enter_context(torch.cuda.stream(self._stream))
        return scope

    def _raw(self, tensor: torch.Tensor, tag: int, send: bool) -> TransferStats:
        if not tensor.is_contiguous():
            raise ValueError("raw transfers take a contiguous tensor")
        with self._lock, self._scope():
            self._check_usable()
            started = time.perf_counter()
            works = []
            try:
                op = self._group.send if send else self._group.recv
                works.append(op([tensor.view(-1)], 1 - self.rank, wire_tag(tag, 0)))
                self._wait(works[0])
                if self._stream is not None:
                    self._stream.synchronize()
            except Exception as error:
                raise self._fail(error, works) from error
        return TransferStats(0, tensor.numel() * tensor.element_size(), time.perf_counter() - started)

    def _prepare(self, kv_cache: KVCache, block_ids: Sequence[int], tag: int, unique: bool = False):
        """Check the arguments before anything touches the wire.

        Returns (layout, block index on the cache's device, message plan)."""
        if not isinstance(tag, int) or tag < 0:
            raise ValueError(f"tag must be a non-negative int, got {tag!r}")
        keys = kv_cache.layers[0][0]
        if keys.device != self.device:
            raise ValueError(f"cache on {keys.device}, channel on {self.device}")
        index = torch.tensor(list(block_ids), dtype=torch.long)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= keys.shape[0]):
            raise ValueError(f"block id out of range 0..{keys.shape[0] - 1}")
        if unique and len(torch.unique(index)) != len(index):
            raise ValueError("duplicate receiver block ids: two blocks would land in one")
        spec = KvLayoutSpec.from_kv_layout(kv_cache.layout)
        return spec, index.to(keys.device), plan_messages(spec, len(index), self.message_bytes)

    def _check_usable(self) -> None:
        if self._broken_reason is not None or self._group is None:
            raise KvTransferError(
                f"channel {self.channel_id} is broken ({self._broken_reason}); connect a new one"
            )

    def _staging_slots(self) -> list[torch.Tensor]:
        """`num_slots` byte views of the staging memory, message_bytes each (any dtype fits)."""
        if self._staging is None:
            stride = -(-self.message_bytes // 64) * 64  # slots aligned for _wide's views
            self._staging = torch.empty(self.num_slots, stride, dtype=torch.uint8, device=self.device)
        return [slot[: self.message_bytes] for slot in self._staging]

    def _wait(self, work) -> None:
        """Wait for one message, at most the channel's timeout; raises on timeout or peer failure."""
        if self.backend == "gloo":
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            return
        # NCCL's wait() only orders streams; poll to bound the time on the CPU.
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no message within {self.timeout_s:g} s")
            time.sleep(50e-6)
        work.wait()

    def _release(self) -> None:
        """Drop the group (which closes its connections), the store and staging; lock held."""
        if self._group is not None:
            abort_group(self._group)
        # NOTE: a receive still posted into staging memory is safe to drop with it: Gloo
        # holds unbound buffers by weak pointer and waits out a read in progress.
        self._group = None
        self._store = None
        self._store_server = None
        self._staging = None

    def _fail(self, error: Exception, works: list) -> KvTransferError:
        """Break the channel after a failed transfer (lock held); returns the error to raise.

        The group goes at once, which closes its connections: the peer's side of the
        transfer fails now instead of at its timeout. A live work (a send or receive)
        keeps the connections open, so none may outlive this call: the transfer keeps
        its works in `works` only, and the traceback, whose frames hold the one that
        failed, is dropped (the backend's message says what happened).
        """
        self._broken_reason = f"{type(error).__name__}: {_first_line(error)}"
        works.clear()
        error.__traceback__ = None
        self._release()
        if isinstance(error, ValueError):  # the header disagreed (KvLayoutMismatchError included)
            return KvTransferError(f"channel {self.channel_id}: sender and receiver disagree: {error}")
        message = _first_line(error)
        if isinstance(error, TimeoutError) or "imed out" in message:
            return KvTransferError(
                f"channel {self.channel_id}: timed out after {self.timeout_s:g} s: {message}"
            )
        return KvTransferError(f"channel {self.channel_id}: transfer failed: {message}")


def _typed(slot: torch.Tensor, spec: KvLayoutSpec, numel: int) -> torch.Tensor:
    """The first `numel` elements of a byte slot, as the cache's dtype."""
    return slot[: numel * spec.element_size].view(spec.torch_dtype)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, num_kv_heads, head_dim] -> [num_blocks, row]; a view of the cache."""
    return cache.view(cache.shape[0], -1)


# On the CPU index_copy_ moves one element at a time: viewing rows as the widest
# element that divides them (16-byte complex128 where possible) makes the scatter
# about 2x faster than float32 elements. Bits are only copied, never interpreted.
_WIDE_DTYPES = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """The same bytes as [n, row] of the widest dtype dividing a row (cache and staging agree)."""
    row_bytes = rows.shape[-1] * rows.element_size()
    for size, dtype in _WIDE_DTYPES:
        if row_bytes % size == 0 and (rows.device.type == "cpu" or not dtype.is_complex):
            return rows.view(dtype)
    return rows.view(torch.uint8)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
