"""KV handoff data plane: block layout check, two-rank torch.distributed channels
(Gloo for CPU caches, NCCL for CUDA), block transfer, checksums, and leases."""

from kvtransfer.channel import KvChannel, KvTransferError, StoreServer, TransferStats
from kvtransfer.checksum import block_checksums
from kvtransfer.layout import KvLayoutMismatchError, KvLayoutSpec
from kvtransfer.lease import KvLease, KvLeaseTable, LeaseState

__all__ = [
    "KvChannel",
    "KvTransferError",
    "StoreServer",
    "TransferStats",
    "block_checksums",
    "KvLayoutMismatchError",
    "KvLayoutSpec",
    "KvLease",
    "KvLeaseTable",
    "LeaseState",
]
