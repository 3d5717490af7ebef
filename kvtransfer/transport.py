"""The KV handoff's data plane behind one small interface.

A channel joins one prefill worker (the sender) to one decode worker (the
receiver). The receiver offers it, the sender joins, and from then on each
transfer is a `send_blocks` on one side paired with a `recv_blocks` on the other
under a tag both were given:

    receiver                                  sender
    offer = listen(id, host, device, t)
    offer.rendezvous ----- (control plane, gRPC OpenKvChannel) ----->
    transport = offer.accept()    <======>    transport = join(rendezvous, device)
    transport.recv_blocks(...)    <======     transport.send_blocks(...)

(`listen` and `join`, which build the transport for a device, are in connect.py.)

Three transports implement it (the `transport` of a channel, chosen by
endpoint.py): "ipc" on one host (`IpcChannel`, ipc.py: the sender copies straight
into the receiver's cache, shared as a memfd segment or through CUDA IPC), and a
two-rank torch.distributed group across hosts (`KvChannel`, channel.py: "gloo" for
CPU caches, "nccl" for CUDA ones). Callers above kvtransfer
(prefill_worker/kv_sender.py, decode_worker/kv_receiver.py) see only this module,
connect.py and endpoint.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.kv.cache import KVCache


class KvTransferError(RuntimeError):
    """A rendezvous or transfer failed or timed out. The transport is then broken: close
    it and open a new channel (under a new channel id).

    `in_doubt`: a receive failed while the sender may still be writing into its blocks
    (a sender that writes into the receiver's memory itself, and stopped answering
    mid-copy). The blocks must not be reused until `KvTransport.wait_settled`."""

    def __init__(self, message: str, *, in_doubt: bool = False) -> None:
        super().__init__(message)
        self.in_doubt = in_doubt


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one transfer (or raw send/recv) moved, and how long it took on this side."""

    num_blocks: int
    num_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """What the sender needs to join a channel the receiver offers: its id, the
    transport, where the receiver waits for the sender (gloo, nccl: the host and port
    of its TCP store; ipc: the name of its abstract Unix socket), the timeout of the
    join and of every later wait, and the channel's one-time secret. Store and socket
    are open to whoever reaches them, so each side proves it holds the secret before it
    trusts the other (group.py, ipc.py); it travels only over the control plane, which
    TLS authenticates."""

    channel_id: str
    host: str
    port: int
    timeout_s: float
    secret: bytes = field(repr=False)
    transport: str = "gloo"
    socket: str = ""  # ipc: the abstract socket's name (without the leading NUL)


class KvTransport(ABC):
    """One end of an open channel. Every call blocks its thread until done or failed
    (run them off the event loop, one at a time per channel); any failure raises
    KvTransferError and breaks the transport for good.

    Sender block src_ids[i] lands in receiver block dst_ids[i]; both sides are given
    both lists, so each can plan the transfer without a round trip, and the receiver
    checks that both agree before any byte lands in its cache.
    """

    backend: str  # the transport: "ipc", "gloo" or "nccl"

    @property
    @abstractmethod
    def is_broken(self) -> bool:
        """True once a transfer failed or the transport was closed."""

    @abstractmethod
    def send_blocks(
        self, kv_cache: KVCache, block_ids: Sequence[int], tag: int, peer_block_ids: Sequence[int]
    ) -> TransferStats:
        """Send blocks `block_ids` of `kv_cache` into the receiver's `peer_block_ids`."""

    @abstractmethod
    def recv_blocks(
        self, kv_cache: KVCache, block_ids: Sequence[int], tag: int, peer_block_ids: Sequence[int]
    ) -> TransferStats:
        """Receive the sender's `peer_block_ids` into blocks `block_ids` of `kv_cache`;
        returns once they are in the cache. Blocks not in `block_ids` are never written."""

    @abstractmethod
    def close(self) -> None:
        """Release the transport; idempotent, any thread, never waits for the peer."""

    def wait_settled(self, timeout_s: float) -> bool:
        """After a receive failed `in_doubt`: wait up to `timeout_s` until nothing can write
        into its blocks any more (the sender stopped or is gone); whether it has. A
        transport whose bytes land only in receives it posted is always settled."""
        return True
