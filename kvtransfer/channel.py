"""KvChannel: a two-rank torch.distributed group between one prefill process (rank 0,
the sender) and one decode process (rank 1, the receiver), and the block transfer on it.

A process may hold many channels (one per peer), so groups are built directly on
a TCPStore instead of through init_process_group's single global group. The
receiver hosts the store; the address reaches the sender over gRPC.

Transfer: the blocks of a group of layers are gathered into one staging buffer
and sent while the next group is gathered; the receiver posts every receive up
front and scatters each group into its cache as it lands. Sender block
block_ids[i] lands in receiver block block_ids[i].

Message tags: transfer `tag` (chosen by the receiver, unique per channel) and
layer group g (< MAX_GROUPS) give message tag (tag * MAX_GROUPS + g) mod 2**31.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.kv_cache import KVCache

MAX_GROUPS = 64
# Layers per message are chosen so a message carries at least this many bytes
# (loopback Gloo reaches its bandwidth from ~1 MB; fewer, larger messages cost less).
MIN_MESSAGE_BYTES = 1024 * 1024
TAG_MODULUS = 2**31


class KvTransferError(RuntimeError):
    """A rendezvous or transfer failed or timed out; the channel is then broken."""


@dataclass(frozen=True, slots=True)
class TransferStats:
    num_blocks: int
    num_bytes: int
    seconds: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.num_bytes / self.seconds if self.seconds > 0 else float("inf")


class StoreServer:
    """The rendezvous store a receiver hosts for one channel (port chosen by the OS)."""

    def __init__(self, host: str, timeout_s: float = 60.0) -> None:
        self.host = host
        self.store = dist.TCPStore(
            host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.port = self.store.port


class KvChannel:
    """One (prefill, decode) pair's group. Transfers on it run one at a time."""

    def __init__(self, channel_id: str, group, rank: int, backend: str, timeout_s: float, store) -> None:
        self.channel_id = channel_id
        self.rank = rank
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._group = group
        self._store = store  # kept alive: the group's rendezvous state lives there
        self._lock = threading.Lock()
        self.is_broken = False
        # Staging memory reused by every transfer (they run one at a time): fresh
        # buffers would page-fault tens of MB per transfer, costing more than the copy.
        self._staging: torch.Tensor | None = None

    # ------------------------------------------------------------- lifecycle
    @staticmethod
    def host_store(host: str = "127.0.0.1") -> StoreServer:
        return StoreServer(host)

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
    ) -> KvChannel:
        """Join the two-rank group; blocks until the peer joined too (or `timeout_s`)."""
        device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            base = store.store if store is not None else dist.TCPStore(
                host, port, 2, False, timeout=timeout
            )
            prefixed = dist.PrefixStore(f"{channel_id}/", base)
            if device.type == "cuda":
                torch.cuda.set_device(device)
                options = dist.ProcessGroupNCCL.Options()
                group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
                backend = "nccl"
            else:
                group = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
                backend = "gloo"
        except (RuntimeError, ValueError) as error:  # store or rendezvous timeout, refused connection
            raise KvTransferError(f"channel {channel_id}: rendezvous failed: {error}") from error
        return cls(channel_id, group, rank, backend, timeout_s, (store, base))

    def close(self) -> None:
        """Drop the group. Never blocks on the peer (it may be gone)."""
        group, self._group = self._group, None
        self.is_broken = True
        if group is not None and self.backend == "nccl":
            try:
                group.abort()
            except (AttributeError, RuntimeError):
                pass
        self._store = None

    # ------------------------------------------------------------- transfers
    def send_blocks(self, kv_cache: KVCache, block_ids: Sequence[int], tag: int) -> TransferStats:
        """Send those blocks of every layer (rank 0 only). Raises KvTransferError."""
        assert self.rank == 0, "the prefill side sends"
        with self._lock:
            return self._transfer(kv_cache, block_ids, tag, send=True)

    def recv_blocks(self, kv_cache: KVCache, block_ids: Sequence[int], tag: int) -> TransferStats:
        """Receive into those blocks of every layer (rank 1 only). Raises KvTransferError."""
        assert self.rank == 1, "the decode side receives"
        with self._lock:
            return self._transfer(kv_cache, block_ids, tag, send=False)

    def raw_send(self, tensor: torch.Tensor, tag: int) -> None:
        """One plain send of `tensor` (for bandwidth comparisons)."""
        self._wait(self._group.send([tensor], 1 - self.rank, tag % TAG_MODULUS))

    def raw_recv(self, tensor: torch.Tensor, tag: int) -> None:
        self._wait(self._group.recv([tensor], 1 - self.rank, tag % TAG_MODULUS))

    def _transfer(self, kv_cache: KVCache, block_ids: Sequence[int], tag: int, send: bool) -> TransferStats:
        if self.is_broken or self._group is None:
            raise KvTransferError(f"channel {self.channel_id} is broken")
        started = time.perf_counter()
        layers = kv_cache.layers
        num_blocks = len(block_ids)
        if num_blocks == 0:
            return TransferStats(0, 0, 0.0)
        keys = layers[0][0]
        device = keys.device
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
        block_shape = keys.shape[1:]  # [block_size, KvH, Dh]
        bytes_per_layer = 2 * num_blocks * keys[0].numel() * keys.element_size()
        num_layers = len(layers)
        per_group = max(1, min(num_layers, -(-MIN_MESSAGE_BYTES // bytes_per_layer)))
        per_group = max(per_group, -(-num_layers // MAX_GROUPS))
        groups = [range(start, min(start + per_group, num_layers)) for start in range(0, num_layers, per_group)]
        peer = 1 - self.rank
        buffers = self._buffers(keys, [(len(g), 2, num_blocks, *block_shape) for g in groups])
        try:
            if send:
                works = []
                for g, group_layers in enumerate(groups):
                    buffer = buffers[g]  # [G, 2, n, block_size, KvH, Dh]
                    for i, layer in enumerate(group_layers):
                        layer_keys, layer_values = layers[layer]
                        torch.index_select(layer_keys, 0, index, out=buffer[i, 0])
                        torch.index_select(layer_values, 0, index, out=buffer[i, 1])
                    if device.type == "cuda":
                        torch.cuda.current_stream(device).synchronize()
                    works.append((self._group.send([buffer], peer, self._tag(tag, g)), buffer))
                for work, _ in works:
                    self._wait(work)
            else:
                posted = []
                for g, group_layers in enumerate(groups):
                    buffer = buffers[g]
                    posted.append((self._group.recv([buffer], peer, self._tag(tag, g)), buffer, group_layers))
                for work, buffer, group_layers in posted:
                    self._wait(work)
                    for i, layer in enumerate(group_layers):
                        layer_keys, layer_values = layers[layer]
                        layer_keys.index_copy_(0, index, buffer[i, 0])
                        layer_values.index_copy_(0, index, buffer[i, 1])
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
        except KvTransferError:
            self.is_broken = True
            raise
        except RuntimeError as error:  # Gloo/NCCL: peer closed, connection reset
            self.is_broken = True
            raise KvTransferError(f"channel {self.channel_id}: transfer failed: {error}") from error
        return TransferStats(num_blocks, bytes_per_layer * num_layers, time.perf_counter() - started)

    def _buffers(self, like: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Views of the staging memory, one per message, back to back."""
        sizes = [torch.Size(shape).numel() for shape in shapes]
        total = sum(sizes)
        staging = self._staging
        if staging is None or staging.numel() < total or staging.dtype != like.dtype or staging.device != like.device:
            staging = self._staging = torch.empty(total, dtype=like.dtype, device=like.device)
        views, offset = [], 0
        for shape, size in zip(shapes, sizes):
            views.append(staging[offset : offset + size].view(shape))
            offset += size
        return views

    @staticmethod
    def _tag(tag: int, group: int) -> int:
        return (tag * MAX_GROUPS + group) % TAG_MODULUS

    def _wait(self, work) -> None:
        try:
            completed = work.wait(self.timeout)
        except RuntimeError as error:
            self.is_broken = True
            message = str(error)
            if "imed out" in message or "imeout" in message:
                raise KvTransferError(f"channel {self.channel_id}: timed out after "
                                      f"{self.timeout.total_seconds():.0f} s") from error
            raise KvTransferError(f"channel {self.channel_id}: {message}") from error
        if completed is False:
            self.is_broken = True
            raise KvTransferError(f"channel {self.channel_id}: timed out")
