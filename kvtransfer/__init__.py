"""KV handoff data plane: layout check, two-rank torch.distributed channels (Gloo for CPU
caches, NCCL for CUDA) that move KV blocks between processes, checksums, and leases."""

from kvtransfer.channel import KvChannel, KvTransferError, TransferStats
from kvtransfer.checksum import block_checksums
from kvtransfer.group import StoreServer
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
