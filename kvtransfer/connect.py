"""Opening a channel: the receiver `listen`s and the sender `join`s (see transport.py).

Which transport a channel gets is decided here, by the caches' device: today a
two-rank torch.distributed group (kvtransfer/channel.py), Gloo for CPU caches and
NCCL for CUDA ones.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtransfer.channel import KvChannel
from kvtransfer.group import SECRET_BYTES
from kvtransfer.transport import KvTransport, Rendezvous


@dataclass(frozen=True)
class ChannelOffer:
    """A channel the receiver hosts: send `rendezvous` to the sender, then `accept()`
    (blocking) returns the transport once the sender has joined, or raises
    KvTransferError when it does not within the rendezvous timeout."""

    rendezvous: Rendezvous
    accept: Callable[[], KvTransport]


def listen(channel_id: str, host: str, device: torch.device | str, timeout_s: float) -> ChannelOffer:
    """Receiver side: start hosting a channel on `host` for a cache on `device`, with a
    fresh secret only the sender this offer is sent to learns."""
    store = KvChannel.host_store(host)
    rendezvous = Rendezvous(channel_id, host, store.port, timeout_s, secrets.token_bytes(SECRET_BYTES))
    return ChannelOffer(rendezvous, lambda: KvChannel.connect(
        channel_id=channel_id, host=host, port=store.port, rank=1, device=device, timeout_s=timeout_s,
        secret=rendezvous.secret, store=store,
    ))


def join(rendezvous: Rendezvous, device: torch.device | str) -> KvTransport:
    """Sender side: join the channel `rendezvous` names, for a cache on `device`."""
    return KvChannel.connect(
        channel_id=rendezvous.channel_id, host=rendezvous.host, port=rendezvous.port, rank=0, device=device,
        timeout_s=rendezvous.timeout_s, secret=rendezvous.secret,
    )
