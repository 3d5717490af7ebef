"""The ipc transport: two processes on one host, the sender copying a request's blocks
straight into the receiver's cache. No serialization and no socket in the data path.

The receiver (decode worker) shares its whole cache with each channel, exported once
(ipc_memory.py; a decode worker exports it at startup): on CPU the cache lives in a
memfd segment (engine/kv/shared_memory.py) whose descriptor it passes over the channel's
Unix socket (SCM_RIGHTS); on CUDA it passes a CUDA IPC handle of the cache's allocation
(what torch.multiprocessing's tensor reductions send, as plain fields: no pickle).
The sender maps it and, per transfer, copies each run of blocks from its cache into
the receiver's (on CUDA on a stream of its own), then says so.

The socket (an abstract-namespace SOCK_SEQPACKET socket, so no file to remove, and a
message per frame) carries only control frames:

    sender                                    receiver
    HELLO   proof, layout            ------>  checks the proof, then the layout
            <------  WELCOME proof, layout, the cache (fd or CUDA handle)
    READY   (mapped)                 ------>
    ... per transfer ...
    HEADER  the transfer's header    ------>  checked (layout, count, tag, block ids);
            <------  GO tag                   nothing lands before this
    copies into the receiver's cache
    DONE    tag, bytes               ------>  the blocks are in place

    REFUSE  reason                   either way, instead of the frame expected
    ABORT   tag                      receiver, after a GO, when it stopped waiting
    ABORTED tag                      sender: seen between copies, it stopped copying

A refusal leaves the receiver's cache untouched: the sender copies only after a GO.
A peer that dies closes the socket, so the survivor's wait ends at once (EOF), and a
sender drops the mapping of a dead receiver's cache as soon as it notices
(`is_broken`). A receiver that stops waiting after its GO (the sender is alive but
silent: frozen, or stuck) cannot know whether the sender is still writing into those
blocks, so the failure is `in_doubt`: the caller keeps the blocks out of use until
`wait_settled` sees the sender answer the ABORT, finish, or go away.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import torch

from engine.errors import first_line
from engine.kv.cache import KVCache
from kvtransfer.ipc_frames import (
    ABORT,
    ABORTED,
    DONE,
    GO,
    HEADER,
    HELLO,
    READY,
    REFUSE,
    WELCOME,
    Frames,
    PeerGone,
    close_fds,
    tag_bytes,
    tag_of,
)
from kvtransfer.ipc_memory import (compile_copy_rows, copies_in_one_launch, copy_rows_on_device, export_cache,
                                   index_on, map_cache)
from kvtransfer.layout import KvLayoutSpec
from kvtransfer.proof import channel_proof, check_secret, is_proof
from kvtransfer.transport import KvTransferError, KvTransport, TransferStats
from kvtransfer.wire import HEADER_LEN, TransferHeader, prepare_transfer, transfer_scope, wide_rows

logger = logging.getLogger(__name__)

# Bytes per copy. On CPU the sender looks for an ABORT between copies, so a receiver
# that gave up is not written into for long; on CUDA copies are queued at once and
# waited for together.
COPY_BYTES = {"cpu": 16 << 20, "cuda": 256 << 20}
# How long a connection to the receiver's socket has to say HELLO.
HELLO_TIMEOUT_S = 2.0
# Runs of consecutive blocks shorter than this are gathered and scattered with one
# index_select / index_copy_ per copy instead of a copy each (small blocks, scattered).
MIN_RUN_BYTES = 64 << 10


class IpcChannel(KvTransport):
    """One (prefill, decode) pair on one host: rank 0 copies blocks into rank 1's cache.

    Every call blocks its thread until done or failed; calls are serialized by a lock.
    Any failure raises KvTransferError and breaks the channel for good. The receiver's
    transfers land only in the cache it shared when the channel opened.
    """

    backend = "ipc"

    def __init__(self, *, channel_id: str, rank: int, frames: Frames, device: torch.device, timeout_s: float,
                 own_rows: torch.Tensor | None = None, peer_rows: torch.Tensor | None = None) -> None:
        self.channel_id = channel_id
        self.rank = rank
        self.device = device
        self.timeout_s = timeout_s
        self._frames: Frames | None = frames
        self._own_pointer = None if own_rows is None else own_rows.data_ptr()  # receiver: the cache it shared
        self._peer_rows = peer_rows  # sender: the receiver's cache, mapped [num_blocks, row]
        self._lock = threading.Lock()
        self._broken_reason: str | None = None
        self._unsettled_tag: int | None = None  # receiver: a transfer given up on after its GO
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ------------------------------------------------------------ opening

    @classmethod
    def listen(cls, channel_id: str, kv_cache: KVCache, timeout_s: float, secret: bytes,
               ) -> tuple[str, Callable[[], IpcChannel], Callable[[], None]]:
        """Receiver: start waiting on a fresh abstract socket for the sender of this channel.
        Returns the socket's name (for the Rendezvous), `accept`, which blocks until the
        sender has joined (KvTransferError if it does not within `timeout_s`), and `cancel`,
        which makes a waiting `accept` give up now (the channel's open failed elsewhere).
        Raises KvTransferError at once if the cache cannot be shared."""
        check_secret(secret)
        export, fds = export_cache(kv_cache)
        name = f"baton-kv-{secrets.token_hex(16)}"  # the proofs authenticate, whoever finds the name
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind("\0" + name)
            listener.listen(4)
        except BaseException:
            listener.close()
            raise
        # shutdown() does not wake an accept() blocked on a Unix socket (a stopped worker
        # waited out the whole timeout): the wait is on the listener and a socket pair's
        # end, which cancel() writes to.
        wake, waker = socket.socketpair()
        cancelled = threading.Event()

        def accept() -> IpcChannel:
            try:
                return cls._accept(listener, wake, channel_id, kv_cache, timeout_s, secret, export, fds, cancelled)
            finally:
                listener.close()
                wake.close()
                waker.close()

        def cancel() -> None:
            cancelled.set()
            with contextlib.suppress(OSError):  # closed already: accept() has returned
                waker.send(b"x")

        return name, accept, cancel

    @classmethod
    def _accept(cls, listener: socket.socket, wake: socket.socket, channel_id: str, kv_cache: KVCache,
                timeout_s: float, secret: bytes, export: dict, fds: list[int], cancelled: threading.Event,
                ) -> IpcChannel:
        deadline = time.monotonic() + timeout_s
        spec = KvLayoutSpec.from_kv_layout(kv_cache.layout)
        listener.setblocking(False)
        while True:
            remaining = deadline - time.monotonic()
            if cancelled.is_set():
                raise KvTransferError(f"channel {channel_id}: its opening was cancelled")
            if remaining <= 0:
                raise KvTransferError(f"channel {channel_id}: peer did not join within {timeout_s:g} s")
            readable, _, _ = select.select([listener, wake], [], [], remaining)
            if listener not in readable:
                continue  # cancelled (checked above), or the time is up
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):  # the connection went away before we took it
                continue
            conn.setblocking(True)
            # A connection that does not say HELLO at once is not the sender we wait for (it sends
            # HELLO right after connecting): it may not hold up the one that is.
            frames = Frames(conn, max(0.1, min(HELLO_TIMEOUT_S, timeout_s, deadline - time.monotonic())))
            try:
                _, payload, stray = frames.recv(HELLO)
                close_fds(stray)
                hello = json.loads(payload)
                if not is_proof(bytes.fromhex(hello["proof"]), secret, channel_id, 0):
                    raise PermissionError("a peer without the channel's secret")
            except (ValueError, KeyError, TypeError, TimeoutError, PermissionError, KvTransferError) as error:
                # Anyone on the host may reach the socket: a stranger is dropped, and we
                # wait on for the sender we were told of.
                logger.warning("KV channel %s: refused a connection: %s", channel_id, first_line(error))
                with contextlib.suppress(OSError, KvTransferError):
                    frames.send(REFUSE, b"the channel's secret was not proved")
                frames.close()
                continue
            try:
                theirs = KvLayoutSpec(**hello["layout"])
                spec.check_matches(theirs)
            except (ValueError, TypeError, KeyError) as error:
                with contextlib.suppress(OSError, KvTransferError):
                    frames.send(REFUSE, str(error).encode())
                frames.close()
                raise KvTransferError(f"channel {channel_id}: sender and receiver disagree: {error}") from error
            welcome = {"proof": channel_proof(secret, channel_id, 1).hex(), "layout": _spec_dict(spec),
                       "num_blocks": kv_cache.num_blocks, "cache": export}
            # The sender proved itself: it has the channel's timeout to map the cache (a large
            # one takes a while), not the stranger's allowance for HELLO.
            frames.timeout_s = max(0.1, deadline - time.monotonic())
            try:
                frames.send(WELCOME, json.dumps(welcome).encode(), fds)
                kind, payload, stray = frames.recv(READY)
                close_fds(stray)
            except (OSError, ValueError, TimeoutError, KvTransferError) as error:
                frames.close()
                raise KvTransferError(f"channel {channel_id}: the sender did not join: {first_line(error)}") from error
            if kind == REFUSE:
                frames.close()
                raise KvTransferError(f"channel {channel_id}: the sender refused: {payload.decode(errors='replace')}")
            frames.timeout_s = timeout_s
            return cls(channel_id=channel_id, rank=1, frames=frames, device=kv_cache.blocks.device,
                       timeout_s=timeout_s, own_rows=kv_cache.block_rows)

    @classmethod
    def join(cls, channel_id: str, socket_name: str, kv_cache: KVCache, timeout_s: float, secret: bytes) -> IpcChannel:
        """Sender: connect to the receiver's socket, prove ourselves, map its cache.
        KvTransferError if it is not there, is not who it should be, or differs."""
        check_secret(secret)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + socket_name)
        except OSError as error:
            sock.close()
            raise KvTransferError(f"channel {channel_id}: no ipc socket to join ({first_line(error)}); is the decode "
                                  "worker on this host and in this network namespace?") from None
        frames = Frames(sock, timeout_s)
        spec = KvLayoutSpec.from_kv_layout(kv_cache.layout)
        fds: list[int] = []
        try:
            frames.send(HELLO, json.dumps({"proof": channel_proof(secret, channel_id, 0).hex(),
                                           "layout": _spec_dict(spec)}).encode())
            kind, payload, fds = frames.recv(WELCOME)
            if kind == REFUSE:
                raise KvTransferError(f"channel {channel_id}: the receiver refused: "
                                      f"{payload.decode(errors='replace')}")
            welcome = json.loads(payload)
            if not is_proof(bytes.fromhex(welcome["proof"]), secret, channel_id, 1):
                raise KvTransferError(f"channel {channel_id}: the socket's owner does not hold the channel's secret")
            theirs = KvLayoutSpec(**welcome["layout"])
            spec.check_matches(theirs)
            peer_rows = map_cache(welcome["cache"], fds, theirs, int(welcome["num_blocks"]), kv_cache.blocks.device)
            if kv_cache.blocks.device.type == "cuda" and peer_rows.device == kv_cache.blocks.device:
                compile_copy_rows(peer_rows)
            frames.send(READY)
        except BaseException as error:
            if isinstance(error, (ValueError, KeyError, TypeError)):  # the layouts differ, or a malformed frame
                with contextlib.suppress(OSError, KvTransferError):
                    frames.send(REFUSE, str(error).encode())
            frames.close()
            if isinstance(error, KvTransferError):
                raise
            if isinstance(error, (ValueError, KeyError, TypeError)):
                raise KvTransferError(f"channel {channel_id}: sender and receiver disagree: {error}") from error
            if isinstance(error, (OSError, TimeoutError)):
                raise KvTransferError(f"channel {channel_id}: peer did not answer within {timeout_s:g} s: "
                                      f"{first_line(error)}") from error
            raise
        finally:
            close_fds(fds)  # the mapping, if made, holds a descriptor of its own
        return cls(channel_id=channel_id, rank=0, frames=frames, device=kv_cache.blocks.device, timeout_s=timeout_s,
                   peer_rows=peer_rows)

    # ------------------------------------------------------------ lifecycle

    @property
    def is_broken(self) -> bool:
        """True once a transfer failed, the channel was closed, or (checked while no
        transfer runs) the peer is gone."""
        if self._broken_reason is not None:
            return True
        if self._lock.acquire(blocking=False):
            try:
                frames = self._frames
                if frames is not None and self._unsettled_tag is None and frames.has_input():
                    # Nothing is due between transfers: input now is EOF, or a peer out of step.
                    self._broken_reason = "the peer is gone"
                    self._release()
            finally:
                self._lock.release()
        return self._broken_reason is not None

    def close(self) -> None:
        """Close the socket and drop the mapping of the peer's cache; idempotent, any thread.
        A transfer running in another thread holds the lock until it ends; close waits."""
        if self._broken_reason is None:
            self._broken_reason = "closed"
        with self._lock:
            self._unsettled_tag = None  # closing gives up on learning when it settles
            self._release()

    def wait_settled(self, timeout_s: float) -> bool:
        if self._unsettled_tag is None:
            return True
        with self._lock:
            if self._frames is None:
                self._unsettled_tag = None
                return True
            try:
                kind, payload, fds = self._frames.recv(DONE, ABORTED, timeout_s=timeout_s)
                close_fds(fds)
            except TimeoutError:
                return False
            except (KvTransferError, OSError, ValueError):  # gone, or out of step: nothing more comes
                pass
            self._unsettled_tag = None
            self._release()
            return True

    # ------------------------------------------------------------ transfers

    def send_blocks(self, kv_cache: KVCache, block_ids: Sequence[int], tag: int,
                    peer_block_ids: Sequence[int]) -> TransferStats:
        """Copy blocks `block_ids` into the receiver's `peer_block_ids` once it has checked
        the header; returns once they are in its cache. Rank 0 only."""
        if self.rank != 0:
            raise ValueError("send_blocks is for rank 0, the prefill side")
        if kv_cache.blocks.device != self.device:
            raise ValueError(f"cache on {kv_cache.blocks.device}, channel on {self.device}")
        prepared = prepare_transfer(kv_cache, block_ids, peer_block_ids, tag, is_sender=True,
                                    message_bytes=COPY_BYTES[self.device.type], min_run_bytes=MIN_RUN_BYTES)
        with self._lock, self._scope():
            self._check_usable()
            if any(i >= self._peer_rows.shape[0] for i in prepared.dst_ids):
                raise ValueError(f"receiver block id out of range 0..{self._peer_rows.shape[0] - 1}")
            started = time.perf_counter()
            try:
                header = TransferHeader(prepared.spec, len(prepared.src_ids), tag, prepared.digest)
                self._frames.send(HEADER, header.encode().numpy().tobytes())
                kind, payload, fds = self._frames.recv(GO)
                close_fds(fds)
                if kind == REFUSE:
                    raise ValueError(payload.decode(errors="replace"))
                if tag_of(payload) != tag:
                    raise ValueError(f"the receiver let transfer {tag_of(payload)} go, not {tag}")
                self._copy(kv_cache.block_rows, prepared, tag)
                self._frames.send(DONE, tag_bytes(tag) + struct.pack("<Q", len(prepared.src_ids) *
                                                                       prepared.spec.bytes_per_block))
            except Exception as error:
                self._drain()  # nothing of ours may still land once we say we stopped, or close
                raise self._fail(error) from None
        return TransferStats(len(prepared.src_ids), len(prepared.src_ids) * prepared.spec.bytes_per_block,
                             time.perf_counter() - started)

    def recv_blocks(self, kv_cache: KVCache, block_ids: Sequence[int], tag: int,
                    peer_block_ids: Sequence[int]) -> TransferStats:
        """Let transfer `tag` land in blocks `block_ids` once its header checks out, and
        wait until the sender says they are in place. Rank 1 only; `kv_cache` is the cache
        this side shared. A refused transfer leaves the cache untouched."""
        if self.rank != 1:
            raise ValueError("recv_blocks is for rank 1, the decode side")
        if kv_cache.block_rows.data_ptr() != self._own_pointer:
            raise ValueError("an ipc channel receives into the cache it shared when it opened")
        prepared = prepare_transfer(kv_cache, peer_block_ids, block_ids, tag, is_sender=False,
                                    message_bytes=COPY_BYTES[self.device.type], min_run_bytes=MIN_RUN_BYTES)
        with self._lock:
            self._check_usable()
            started = time.perf_counter()
            let_go = False
            try:
                _, payload, fds = self._frames.recv(HEADER)
                close_fds(fds)
                try:
                    theirs = _decode_header(payload)
                    prepared.spec.check_matches(theirs.spec)
                    if theirs.tag != tag or theirs.num_blocks != len(prepared.dst_ids):
                        raise ValueError(f"sender sends transfer {theirs.tag} of {theirs.num_blocks} blocks, "
                                         f"receiver expects transfer {tag} of {len(prepared.dst_ids)}")
                    if theirs.digest != prepared.digest:
                        raise ValueError(f"transfer {tag}: sender and receiver were given different block ids")
                except ValueError as refusal:
                    with contextlib.suppress(OSError, KvTransferError):
                        self._frames.send(REFUSE, str(refusal).encode())
                    raise
                if self.device.type == "cuda":
                    # The blocks were this process's until now, and its queued work (a swap-out
                    # reading blocks just freed, the step in flight) runs on the default
                    # stream: the sender writes only after it has.
                    torch.cuda.default_stream(self.device).synchronize()
                self._frames.send(GO, tag_bytes(tag))
                let_go = True
                kind, payload, fds = self._frames.recv(DONE)
                close_fds(fds)
                if kind == REFUSE:  # the sender stopped on its own: it writes nothing more
                    let_go = False
                    raise KvTransferError(f"the sender failed: {payload.decode(errors='replace')}")
                if tag_of(payload) != tag:
                    raise ValueError(f"the sender finished transfer {tag_of(payload)}, not {tag}")
            except Exception as error:
                raise self._fail(error, tag if let_go else None) from None
        return TransferStats(len(prepared.dst_ids), len(prepared.dst_ids) * prepared.spec.bytes_per_block,
                             time.perf_counter() - started)

    # ------------------------------------------------------------ internals

    def _copy(self, rows: torch.Tensor, prepared, tag: int) -> None:
        """Every block of the plan from `rows` (ours) into the receiver's rows."""
        peer = self._peer_rows
        src_ids, dst_ids, plan = prepared.src_ids, prepared.dst_ids, prepared.plan
        cuda = self._stream is not None
        if cuda and peer.device == rows.device and copies_in_one_launch(plan):
            # Every block in one kernel: a memcpy per scattered block is bound by the host.
            self._check_abort(tag)
            copy_rows_on_device(rows, peer, src_ids, dst_ids)
            self._drain()
            return
        for run in plan.runs:
            self._check_abort(tag)
            src, dst, count = src_ids[run.start], dst_ids[run.start], run.num_blocks
            peer[dst : dst + count].copy_(rows[src : src + count], non_blocking=cuda)
        for begin, end in plan.staged_slices():
            self._check_abort(tag)
            positions = plan.staged[begin:end]
            src = index_on([src_ids[p] for p in positions], rows.device)
            dst = index_on([dst_ids[p] for p in positions], peer.device)
            gathered = wide_rows(rows).index_select(0, src)
            wide_rows(peer).index_copy_(0, dst, gathered.to(peer.device, non_blocking=cuda))
        self._drain()  # in the receiver's memory before we say DONE

    def _drain(self) -> None:
        """CUDA: wait for every copy this channel queued (on its stream, and a scatter on
        another GPU on that GPU's current stream), so that none lands after we say DONE,
        ABORTED, or close. A failure here is the device's: it is not ours to report."""
        if self._stream is None:
            return
        with contextlib.suppress(RuntimeError):
            self._stream.synchronize()
            peer = self._peer_rows
            if peer is not None and peer.device != self.device:
                torch.cuda.current_stream(peer.device).synchronize()

    def _check_abort(self, tag: int) -> None:
        """Between copies: stop if the receiver gave up (ABORT) or is gone."""
        if not self._frames.has_input():
            return
        kind, payload, fds = self._frames.recv(ABORT)
        close_fds(fds)
        if kind == ABORT:
            self._drain()
            with contextlib.suppress(OSError, KvTransferError):
                self._frames.send(ABORTED, payload[:8])
            raise KvTransferError(f"the receiver gave up on transfer {tag} (its timeout)")
        raise KvTransferError(f"the receiver refused transfer {tag}: {payload.decode(errors='replace')}")

    def _scope(self) -> contextlib.AbstractContextManager:
        """CUDA: this channel's device and side stream for the calling thread."""
        return transfer_scope(self._stream, self.device)

    def _check_usable(self) -> None:
        if self._broken_reason is not None or self._frames is None:
            raise KvTransferError(f"channel {self.channel_id} is broken ({self._broken_reason}); connect a new one")

    def _release(self) -> None:
        """Close the socket and drop the peer's cache (lock held), unless a transfer given up
        on is not settled yet: its socket is how we learn when it is."""
        if self._unsettled_tag is not None:
            return
        self._drain()
        if self._frames is not None:
            self._frames.close()
            self._frames = None
        self._peer_rows = None

    def _fail(self, error: Exception, unsettled_tag: int | None = None) -> KvTransferError:
        """Break the channel after a failed transfer (lock held); returns the error to raise.

        `unsettled_tag`: the receiver had let that transfer go and the sender may still be
        copying (unless it is gone): ask it to stop, and keep the socket to learn when it
        has (wait_settled)."""
        self._broken_reason = f"{type(error).__name__}: {first_line(error)}"
        gone = isinstance(error, PeerGone)
        in_doubt = unsettled_tag is not None and not gone
        if in_doubt:
            self._unsettled_tag = unsettled_tag
            with contextlib.suppress(OSError, KvTransferError):
                self._frames.send(ABORT, tag_bytes(unsettled_tag))
        else:
            self._release()
        message = first_line(error)
        if isinstance(error, KvTransferError):
            text = f"channel {self.channel_id}: {message}"
        elif isinstance(error, ValueError):  # the header disagreed, or a frame out of turn
            text = f"channel {self.channel_id}: sender and receiver disagree: {message}"
        elif isinstance(error, TimeoutError):
            text = f"channel {self.channel_id}: timed out after {self.timeout_s:g} s: {message}"
        else:
            text = f"channel {self.channel_id}: transfer failed: {message}"
        return KvTransferError(text, in_doubt=in_doubt)


def _spec_dict(spec: KvLayoutSpec) -> dict:
    return {"num_layers": spec.num_layers, "block_size": spec.block_size, "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "dtype": spec.dtype}


def _decode_header(payload: bytes) -> TransferHeader:
    if len(payload) < 8 * HEADER_LEN:
        raise ValueError(f"a transfer header of {len(payload)} bytes")
    words = torch.frombuffer(bytearray(payload[: 8 * HEADER_LEN]), dtype=torch.int64)
    return TransferHeader.decode(words)
