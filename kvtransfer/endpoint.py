"""Which transport a channel uses, decided from where its two caches live.

Each worker describes its side as a `KvEndpoint`: the host it runs on, its cache's
device (and GPU, by UUID), and the transport its `--kv-transport` asks for. The
receiver (decode worker) learns the sender's from the KV handle, chooses with
`choose_transport` before it offers a channel, and the sender checks the same choice
when it is asked to join, so a transport that cannot work is refused at channel open,
with the reason, never found out by a failed send:

    same host (one kernel, one network namespace)   ipc    shared memory / CUDA IPC
    CPU caches on different hosts                   gloo   torch.distributed over TCP
    CUDA caches on different GPUs                   nccl   torch.distributed over NCCL

"Same host" is one kernel instance (its boot id) and one network namespace: the ipc
transport's control socket is an abstract Unix socket, which lives in a network
namespace, and its memory is a file descriptor passed over that socket. Two
containers of one Kubernetes pod share both; two pods do not, and use gloo or nccl.

Nothing here imports torch: the gateway reads endpoints in KV handles.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import lru_cache

from kvtransfer.transport import KvTransferError

AUTO = "auto"
IPC, NCCL, GLOO = "ipc", "nccl", "gloo"
TRANSPORTS = (IPC, NCCL, GLOO)
TRANSPORT_CHOICES = (AUTO, *TRANSPORTS)  # what --kv-transport takes


class TransportRefusedError(KvTransferError):
    """No transport can join these two caches as the workers are set up (or the one
    forced cannot): refused at channel open, before anything is sent."""


@dataclass(frozen=True, slots=True)
class KvEndpoint:
    """One side of a channel, as the other side and the negotiation see it."""

    hostname: str  # for messages only; host_id decides
    host_id: str  # equal on two processes iff they can share memory (see host_identity)
    device: str  # "cpu" or "cuda"
    gpu_uuid: str = ""  # the cache's GPU, on CUDA
    transport: str = AUTO  # the worker's --kv-transport

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"kv transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {self.transport!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"a KV endpoint's device is cpu or cuda, got {self.device!r}")

    def describe(self) -> str:
        where = f"GPU {self.gpu_uuid}" if self.device == "cuda" else "CPU"
        return f"{where} on {self.hostname}"


def receiver_shares_cache(transport: str) -> bool:
    """Whether a receiver set to `transport` (a --kv-transport) must build its cache so that
    senders on its host can map it (ipc may be chosen). ValueError for no transport's name."""
    if transport not in TRANSPORT_CHOICES:
        raise ValueError(f"kv_transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {transport!r}")
    return transport in (AUTO, IPC)


def source_address(host: str, port: int) -> str:
    """The local address this host sends from towards `host:port`, as its routing table
    says (a UDP connect sends nothing). OSError if no route leads there."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


@lru_cache(maxsize=1)
def host_identity() -> str:
    """This kernel instance and network namespace: `<boot id>/net:<namespace inode>`."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot_id = file.read().strip()
    except OSError:  # not Linux: the ipc transport is Linux-only, so no two hosts match
        boot_id = f"no-boot-id-{socket.gethostname()}-{os.getpid()}"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot_id}/net:{netns}"


def local_endpoint(device_type: str, transport: str, gpu_uuid: str = "") -> KvEndpoint:
    """This process's endpoint for a cache on `device_type` ("cpu"/"cuda"; on CUDA, on the
    GPU with `gpu_uuid`), with the transport this worker was told to use."""
    return KvEndpoint(socket.gethostname(), host_identity(), device_type, gpu_uuid, transport)


def choose_transport(receiver: KvEndpoint, sender: KvEndpoint) -> str:
    """The transport a channel from `sender` into `receiver` uses: the one a side forces
    (both may, if they agree), else ipc on one host, else gloo for CPU caches and nccl
    for CUDA ones. TransportRefusedError, saying why, if none can work."""
    forced = {side.transport for side in (receiver, sender) if side.transport != AUTO}
    if len(forced) > 1:
        raise TransportRefusedError(f"the prefill worker forces --kv-transport {sender.transport} and the decode "
                                    f"worker {receiver.transport}")
    if receiver.device != sender.device:
        raise TransportRefusedError(f"the prefill worker's KV cache is on {sender.describe()} and the decode "
                                    f"worker's on {receiver.describe()}: both must be on CPU, or both on CUDA")
    same_host = receiver.host_id == sender.host_id
    if forced:
        transport = forced.pop()
    elif same_host:
        transport = IPC
    else:
        transport = NCCL if receiver.device == "cuda" else GLOO
    check_transport(transport, receiver, sender)
    return transport


def check_transport(transport: str, receiver: KvEndpoint, sender: KvEndpoint) -> None:
    """TransportRefusedError if `transport` cannot join these two caches."""
    if transport == IPC and receiver.host_id != sender.host_id:
        raise TransportRefusedError(f"ipc needs both workers on one host (one kernel and network namespace); the "
                                    f"prefill worker's cache is on {sender.describe()}, the decode worker's on "
                                    f"{receiver.describe()}: use gloo (CPU) or nccl (CUDA)")
    if transport == GLOO and receiver.device != "cpu":
        raise TransportRefusedError("gloo moves CPU caches; these are on CUDA: use nccl, or ipc on one host")
    if transport == NCCL:
        if receiver.device != "cuda":
            raise TransportRefusedError("nccl moves CUDA caches; these are on CPU: use gloo, or ipc on one host")
        if receiver.gpu_uuid and receiver.gpu_uuid == sender.gpu_uuid:
            raise TransportRefusedError(f"NCCL cannot run two ranks on one GPU, and both caches are on "
                                        f"{receiver.describe()}: use ipc")
    if transport not in TRANSPORTS:
        raise TransportRefusedError(f"unknown kv transport {transport!r}")


def gpu_uuid(device) -> str:
    """The UUID of a CUDA device (a torch.device or index), as this process's torch names it."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)
