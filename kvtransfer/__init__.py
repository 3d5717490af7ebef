"""KV handoff data plane: the transport interface (transport.py) and today's transport,
two-rank torch.distributed channels (Gloo for CPU caches, NCCL for CUDA); the layout
both ends must share, per-block checksums, and the prefill side's leases."""

from kvtransfer.channel import KvChannel
from kvtransfer.checksum import block_checksums
from kvtransfer.layout import KvLayoutMismatchError, KvLayoutSpec
from kvtransfer.lease import KvLease, KvLeaseTable, LeaseState
from kvtransfer.transport import (
    ChannelOffer,
    KvTransferError,
    KvTransport,
    Rendezvous,
    TransferStats,
    join,
    listen,
)

__all__ = [
    "ChannelOffer",
    "KvChannel",
    "KvLayoutMismatchError",
    "KvLayoutSpec",
    "KvLease",
    "KvLeaseTable",
    "KvTransferError",
    "KvTransport",
    "LeaseState",
    "Rendezvous",
    "TransferStats",
    "block_checksums",
    "join",
    "listen",
]
