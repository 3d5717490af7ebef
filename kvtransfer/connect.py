"""Opening a channel: the receiver `listen`s and the sender `join`s (see transport.py).

The transport (endpoint.py chooses it) decides what is built: "ipc" an IpcChannel
(ipc.py) over an abstract Unix socket; "gloo" and "nccl" a two-rank torch.distributed
group (channel.py) whose TCP store the receiver hosts.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv.cache import KVCache
from kvtransfer.channel import KvChannel
from kvtransfer.endpoint import GLOO, IPC, NCCL
from kvtransfer.ipc import IpcChannel
from kvtransfer.proof import SECRET_BYTES
from kvtransfer.transport import KvTransport, Rendezvous


@dataclass(frozen=True)
class ChannelOffer:
    """A channel the receiver hosts: send `rendezvous` to the sender, then `accept()`
    (blocking) returns the transport once the sender has joined, or raises
    KvTransferError when it does not within the rendezvous timeout. `cancel()` (any
    thread) makes a waiting `accept()` give up early where the transport can."""

    rendezvous: Rendezvous
    accept: Callable[[], KvTransport]
    cancel: Callable[[], None] = lambda: None


def listen(channel_id: str, transport: str, host: str, kv_cache: KVCache, timeout_s: float,
           ports: tuple[int, int] | None = None) -> ChannelOffer:
    """Receiver side: start hosting a channel of `transport` into `kv_cache` (gloo and nccl
    host their store on `host`, on a port of `ports` if given), with a fresh secret only
    the sender this offer is sent to learns. KvTransferError if the cache cannot be reached that way (ipc: a CPU cache
    not in shared memory); ValueError for a transport the cache's device cannot use."""
    secret = secrets.token_bytes(SECRET_BYTES)
    device = kv_cache.blocks.device
    _check_device(transport, device.type)
    if transport == IPC:
        name, accept, cancel = IpcChannel.listen(channel_id, kv_cache, timeout_s, secret)
        return ChannelOffer(Rendezvous(channel_id, "", 0, timeout_s, secret, IPC, name), accept, cancel)
    store = KvChannel.host_store(host, ports)
    rendezvous = Rendezvous(channel_id, host, store.port, timeout_s, secret, transport)
    cancelled = threading.Event()
    return ChannelOffer(rendezvous, lambda: KvChannel.connect(
        channel_id=channel_id, host=host, port=store.port, rank=1, device=device, timeout_s=timeout_s,
        secret=rendezvous.secret, store=store, cancelled=cancelled,
    ), cancelled.set)


def join(rendezvous: Rendezvous, kv_cache: KVCache, cancelled: threading.Event | None = None) -> KvTransport:
    """Sender side: join the channel `rendezvous` names, sending from `kv_cache`. Setting
    `cancelled` (another thread) gives up a wait for a receiver that has not come (gloo,
    nccl: an ipc join finds the receiver's socket at once or fails)."""
    device = kv_cache.blocks.device
    _check_device(rendezvous.transport, device.type)
    if rendezvous.transport == IPC:
        return IpcChannel.join(rendezvous.channel_id, rendezvous.socket, kv_cache, rendezvous.timeout_s,
                               rendezvous.secret)
    return KvChannel.connect(
        channel_id=rendezvous.channel_id, host=rendezvous.host, port=rendezvous.port, rank=0, device=device,
        timeout_s=rendezvous.timeout_s, secret=rendezvous.secret, cancelled=cancelled,
    )


def _check_device(transport: str, device_type: str) -> None:
    # KvChannel picks its backend by device: gloo for CPU caches, nccl for CUDA ones.
    wanted = {GLOO: "cpu", NCCL: "cuda"}.get(transport)
    if transport not in (IPC, GLOO, NCCL):
        raise ValueError(f"unknown kv transport {transport!r}")
    if wanted is not None and device_type != wanted:
        raise ValueError(f"the {transport} transport moves {wanted} caches, not {device_type} ones")
