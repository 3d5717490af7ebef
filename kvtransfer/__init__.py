"""KV handoff data plane: the transport interface (transport.py, opened by connect.py,
chosen by endpoint.py) and its transports: ipc within a host (ipc.py: shared memory or
CUDA IPC), two-rank torch.distributed channels across hosts (channel.py: Gloo for CPU
caches, NCCL for CUDA); the layout both ends must share, per-block checksums, and the
prefill side's leases.

The names below are imported from their modules when first used: the wire records
read `KvLayoutSpec` and `Rendezvous` without loading torch.distributed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_attributes

if TYPE_CHECKING:  # for type checkers only: never run
    from kvtransfer.channel import KvChannel
    from kvtransfer.checksum import block_checksums
    from kvtransfer.layout import KvLayoutMismatchError, KvLayoutSpec
    from kvtransfer.lease import KvLease, KvLeaseTable, LeaseState, ReleasedBeforeHeld
    from kvtransfer.connect import ChannelOffer, join, listen
    from kvtransfer.endpoint import KvEndpoint, TransportRefusedError, choose_transport, check_transport
    from kvtransfer.ipc import IpcChannel
    from kvtransfer.transport import KvTransferError, KvTransport, Rendezvous, TransferStats

_LOCATIONS = {
    "KvChannel": "kvtransfer.channel",
    "block_checksums": "kvtransfer.checksum",
    "KvLayoutMismatchError": "kvtransfer.layout",
    "KvLayoutSpec": "kvtransfer.layout",
    "KvLease": "kvtransfer.lease",
    "KvLeaseTable": "kvtransfer.lease",
    "LeaseState": "kvtransfer.lease",
    "ReleasedBeforeHeld": "kvtransfer.lease",
    "ChannelOffer": "kvtransfer.connect",
    "IpcChannel": "kvtransfer.ipc",
    "KvEndpoint": "kvtransfer.endpoint",
    "TransportRefusedError": "kvtransfer.endpoint",
    "check_transport": "kvtransfer.endpoint",
    "choose_transport": "kvtransfer.endpoint",
    "KvTransferError": "kvtransfer.transport",
    "KvTransport": "kvtransfer.transport",
    "Rendezvous": "kvtransfer.transport",
    "TransferStats": "kvtransfer.transport",
    "join": "kvtransfer.connect",
    "listen": "kvtransfer.connect",
}
__all__ = sorted(_LOCATIONS)


__getattr__ = lazy_attributes(__name__, _LOCATIONS)
