"""KvChannel: moves a request's KV blocks from a prefill process's cache (rank 0, the
sender) into a decode process's cache (rank 1, the receiver) over a two-rank
torch.distributed group. Messages and tags: wire.py. The group: group.py.

The caches are block-major (engine.kv.cache.KVCache), so a run of ids that is consecutive on
both sides is one contiguous piece of both caches: the sender posts all its sends
straight from its cache, the receiver checks the header and posts all its receives
straight into its cache, and nothing is copied besides what the backend itself
does. Only runs too short to send alone (small blocks at scattered ids) go through
a staging buffer: gathered by one index_select, scattered by one index_copy_ per
message. Sender block src_ids[i] lands in receiver block dst_ids[i].
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from engine.errors import first_line
from engine.kv.cache import KVCache
from kvtransfer.group import RendezvousCancelled, StoreServer, StoreUnreachableError, abort_group, join_group
from kvtransfer.transport import KvTransferError, KvTransport, TransferStats
from kvtransfer.wire import (
    HEADER_CAPACITY,
    HEADER_LEN,
    MIN_RUN_BYTES,
    TransferHeader,
    prepare_transfer,
    transfer_scope,
    wide_rows,
    wire_tag,
)

# Largest message, per backend: a run of consecutive blocks longer than this goes as
# several messages. Gloo: chosen with kvtransfer/bench.py (figures in docs/kv-transfer.md):
# messages of about a megabyte beat both larger ones and a raw send/recv of the same
# bytes; many messages in flight overlap the receiver's reads with the sender's writes.
# NCCL: each send/recv is a kernel launch, so fewer, larger messages; not yet measured
# (no GPU so far).
DEFAULT_MESSAGE_BYTES = {"gloo": 1 << 20, "nccl": 64 << 20}


class KvChannel(KvTransport):
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
    ) -> None:
        self.channel_id = channel_id
        self.rank = rank
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout_s = timeout_s
        self.message_bytes = message_bytes
        self._group: dist.ProcessGroup | None = group
        self._store = store  # holds the group's rendezvous keys
        self._store_server = store_server
        self._lock = threading.Lock()
        self._broken_reason: str | None = None
        # Staged blocks (short runs) pass through here; grows to the largest transfer's.
        self._staging: torch.Tensor | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ------------------------------------------------------------ lifecycle

    @staticmethod
    def host_store(host: str = "127.0.0.1", ports: tuple[int, int] | None = None) -> StoreServer:
        """Start the rendezvous store (receiver side; on a port of `ports`, if given); its
        host and port go to the sender."""
        return StoreServer(host, ports)

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
        secret: bytes,
        store: StoreServer | None = None,
        message_bytes: int | None = None,
        cancelled: threading.Event | None = None,
    ) -> KvChannel:
        """Join the two-rank group at host:port; returns once the peer has joined too and
        proved it holds `secret` (both sides are given it; see group.py).

        Rank 1 (receiver) passes the StoreServer it hosts; the channel keeps it alive
        and drops it on close(). `channel_id` must be new on that store for every
        connect (an old channel's rendezvous keys stay there). `message_bytes` (both
        sides must agree; None: DEFAULT_MESSAGE_BYTES for the backend) caps a message.
        `timeout_s` bounds the rendezvous and, later, every wait for a message. Gloo for a CPU device, NCCL
        for CUDA. Raises KvTransferError if the peer does not join in time, or before it
        came `cancelled` (another thread's) was set.
        """
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 (sender) or 1 (receiver), got {rank}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if message_bytes is None:
            message_bytes = DEFAULT_MESSAGE_BYTES["nccl" if device.type == "cuda" else "gloo"]
        if message_bytes <= 0:
            raise ValueError("message_bytes must be positive")
        try:
            group, prefixed = join_group(channel_id, host, port, rank, device, timeout_s, secret,
                                         agree={"message_bytes": str(message_bytes),
                                                "min_run_bytes": str(MIN_RUN_BYTES)}, cancelled=cancelled)
        except RendezvousCancelled as error:
            raise KvTransferError(f"channel {channel_id}: {error}") from error
        except ValueError as error:  # joined, but set up differently, or not the peer we were told of
            raise KvTransferError(f"channel {channel_id}: {error}") from error
        except StoreUnreachableError as error:  # the sender could not reach the receiver's store at all
            raise KvTransferError(
                f"channel {channel_id}: could not reach the receiver's rendezvous at {host}:{port} within "
                f"{timeout_s:g} s ({first_line(error)}); check that this host reaches that address (the "
                "decode worker's --transfer-host or --advertise, its --kv-ports, firewalls)"
            ) from error
        except (RuntimeError, OSError) as error:  # DistStoreError, DistNetworkError, refused, unresolvable
            raise KvTransferError(
                f"channel {channel_id}: peer did not join within {timeout_s:g} s: {first_line(error)}"
            ) from error
        return cls(channel_id=channel_id, group=group, store=prefixed, store_server=store, rank=rank,
                   device=device, timeout_s=timeout_s, message_bytes=message_bytes)

    @property
    def is_broken(self) -> bool:
        """True once a transfer failed or the channel was closed; it is never usable again."""
        return self._broken_reason is not None

    def close(self) -> None:
        """Release the group and the store; idempotent, any thread.

        Never waits for the peer (it may be gone); the peer's pending messages fail at
        once ("connection closed"). A transfer running in another thread holds the lock
        until it ends (at the latest when its current wait times out); close waits for it.
        """
        if self._broken_reason is None:
            self._broken_reason = "closed"
        with self._lock:
            self._release()

    # ------------------------------------------------------------ transfers

    def send_blocks(
        self, kv_cache: KVCache, block_ids: Sequence[int], tag: int, peer_block_ids: Sequence[int]
    ) -> TransferStats:
        """Send blocks `block_ids` (every layer's K and V) under transfer `tag`; rank 0 only.

        `peer_block_ids` are the receiver's blocks they land in, position by position;
        both sides pass both lists. Returns once every message has left this process.
        """
        if self.rank != 0:
            raise ValueError("send_blocks is for rank 0, the prefill side")
        spec, plan, digest, block_ids, _ = self._prepare(kv_cache, block_ids, peer_block_ids, tag)
        rows = kv_cache.block_rows  # [num_blocks, block row]
        with self._lock, self._scope():
            self._check_usable()
            started = time.perf_counter()
            works = []  # every send, header first; only here (see _fail)
            try:
                header = TransferHeader(spec, len(block_ids), tag, digest).encode().to(self._comm_device)
                works.append(self._group.send([header], 1, wire_tag(tag, 0)))
                for i, run in enumerate(plan.runs):
                    first = block_ids[run.start]
                    works.append(self._group.send([rows[first : first + run.num_blocks].view(-1)], 1,
                                                  wire_tag(tag, i + 1)))
                if plan.staged:  # gathered while the runs are on the wire
                    staging = self._staging_rows(len(plan.staged), rows)
                    positions = torch.tensor([block_ids[p] for p in plan.staged], device=rows.device)
                    torch.index_select(wide_rows(rows), 0, positions, out=wide_rows(staging))
                    for k, (begin, end) in enumerate(plan.staged_slices()):
                        works.append(self._group.send([staging[begin:end].view(-1)], 1,
                                                      wire_tag(tag, len(plan.runs) + k + 1)))
                # NOTE: wait each Gloo send exactly once: a second wait waits for a second
                # completion, which never comes.
                for work in works:
                    self._wait(work)
            except Exception as error:
                raise self._fail(error, works) from error
        return TransferStats(len(block_ids), len(block_ids) * spec.bytes_per_block, time.perf_counter() - started)

    def recv_blocks(
        self, kv_cache: KVCache, block_ids: Sequence[int], tag: int, peer_block_ids: Sequence[int]
    ) -> TransferStats:
        """Receive transfer `tag` into blocks `block_ids` (every layer's K and V); rank 1 only.

        `peer_block_ids` are the sender's blocks, position by position. Returns once the
        blocks are in the cache. The sender's header is checked before any receive is
        posted: a different layout, block count, tag or id lists raises
        KvTransferError (chained to the KvLayoutMismatchError / ValueError saying
        which). Blocks not in `block_ids` are never written.
        """
        if self.rank != 1:
            raise ValueError("recv_blocks is for rank 1, the decode side")
        spec, plan, digest, _, block_ids = self._prepare(kv_cache, peer_block_ids, block_ids, tag)
        rows = kv_cache.block_rows  # [num_blocks, block row]
        with self._lock, self._scope():
            self._check_usable()
            started = time.perf_counter()
            works = []  # the header's receive, then message i's at works[1 + i]; only here (see _fail)
            try:
                # Over Gloo the header receive takes any smaller message (see wire.py);
                # NCCL wants the exact size.
                capacity = HEADER_CAPACITY if self.backend == "gloo" else HEADER_LEN
                header = torch.empty(capacity, dtype=torch.int64, device=self._comm_device)
                works.append(self._group.recv([header], 0, wire_tag(tag, 0)))
                self._wait(works[0])
                theirs = TransferHeader.decode(header)
                spec.check_matches(theirs.spec)
                if theirs.tag != tag or theirs.num_blocks != len(block_ids):
                    raise ValueError(f"sender sends transfer {theirs.tag} of {theirs.num_blocks} blocks, "
                                     f"receiver expects transfer {tag} of {len(block_ids)}")
                if theirs.digest != digest:
                    raise ValueError(f"transfer {tag}: sender and receiver were given different block ids")
                # Every receive goes out at once, straight into the cache: the backend reads
                # message after message while the sender writes them.
                for i, run in enumerate(plan.runs):
                    first = block_ids[run.start]
                    works.append(self._group.recv([rows[first : first + run.num_blocks].view(-1)], 0,
                                                  wire_tag(tag, i + 1)))
                slices = plan.staged_slices()
                if slices:
                    staging = self._staging_rows(len(plan.staged), rows)
                    positions = torch.tensor([block_ids[p] for p in plan.staged], device=rows.device)
                    for k, (begin, end) in enumerate(slices):
                        works.append(self._group.recv([staging[begin:end].view(-1)], 0,
                                                      wire_tag(tag, len(plan.runs) + k + 1)))
                for work in works[1 : 1 + len(plan.runs)]:
                    self._wait(work)
                for k, (begin, end) in enumerate(slices):  # each staged message scattered as it lands
                    self._wait(works[1 + len(plan.runs) + k])
                    wide_rows(rows).index_copy_(0, positions[begin:end], wide_rows(staging[begin:end]))
                if self._stream is not None:
                    self._stream.synchronize()  # in the cache before we say so
            except Exception as error:
                raise self._fail(error, works) from error
        return TransferStats(len(block_ids), len(block_ids) * spec.bytes_per_block, time.perf_counter() - started)

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
        return transfer_scope(self._stream, self.device)

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

    def _prepare(self, kv_cache: KVCache, src_ids: Sequence[int], dst_ids: Sequence[int], tag: int):
        """Check the arguments before anything touches the wire.

        Returns (layout, message plan, plan digest, src_ids, dst_ids as lists of int)."""
        if kv_cache.blocks.device != self.device:
            raise ValueError(f"cache on {kv_cache.blocks.device}, channel on {self.device}")
        prepared = prepare_transfer(kv_cache, src_ids, dst_ids, tag, is_sender=self.rank == 0,
                                    message_bytes=self.message_bytes)
        return prepared.spec, prepared.plan, prepared.digest, prepared.src_ids, prepared.dst_ids

    def _check_usable(self) -> None:
        if self._broken_reason is not None or self._group is None:
            raise KvTransferError(
                f"channel {self.channel_id} is broken ({self._broken_reason}); connect a new one"
            )

    def _staging_rows(self, num_rows: int, rows: torch.Tensor) -> torch.Tensor:
        """[num_rows, row] of the cache's dtype: the staging memory, grown as needed and
        reused (fresh memory would page-fault on every transfer)."""
        num_bytes = num_rows * rows.shape[1] * rows.element_size()
        if self._staging is None or self._staging.numel() < num_bytes:
            self._staging = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        return self._staging[:num_bytes].view(rows.dtype).view(num_rows, rows.shape[1])

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
        """Drop the group (which closes its connections) and the store; lock held."""
        if self._group is not None:
            abort_group(self._group)
        # NOTE: a receive still posted into the cache is safe to drop with the group:
        # Gloo holds unbound buffers by weak pointer and waits out a read in progress.
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
        self._broken_reason = f"{type(error).__name__}: {first_line(error)}"
        works.clear()
        error.__traceback__ = None
        self._release()
        if isinstance(error, ValueError):  # the header disagreed (KvLayoutMismatchError included)
            return KvTransferError(f"channel {self.channel_id}: sender and receiver disagree: {error}")
        message = first_line(error)
        if isinstance(error, TimeoutError) or "imed out" in message:
            return KvTransferError(
                f"channel {self.channel_id}: timed out after {self.timeout_s:g} s: {message}"
            )
        return KvTransferError(f"channel {self.channel_id}: transfer failed: {message}")
