"""The two-rank process group under a KvChannel: rendezvous store, Gloo or NCCL backend.

A process may hold many channels (one per peer), so each group is built directly on
a TCPStore, under a PrefixStore per channel id, rather than through
init_process_group's single global group.

A TCPStore has no authentication: whoever reaches its port can read its keys (even
list them) and write a rank's address, and so could join a channel as the peer. So
once the group is up, each side sends over it an HMAC of the channel's one-time
secret, which the receiver made and sent to the sender over the authenticated
control plane (OpenKvChannel), and checks the other's before trusting the group. The
secret itself never crosses the store or the group; a stranger, even one that
joined the group, cannot produce the proof, and the channel is refused.
"""

from __future__ import annotations

import contextlib
import datetime
import random
import threading
import time

import torch
import torch.distributed as dist

from kvtransfer.endpoint import source_address
from kvtransfer.proof import PROOF_BYTES, channel_proof, check_secret, is_proof


# The wait for the peer to reach the store looks every PEER_POLL_S[0] s at first, doubling
# to PEER_POLL_S[1]: a cancelled rendezvous ends within that, not at its timeout.
PEER_POLL_S = (0.002, 0.05)


class RendezvousCancelled(Exception):
    """The rendezvous was given up (its `cancelled` event set) before the peer came."""


class StoreUnreachableError(OSError):
    """The rendezvous store's address did not answer (wrong address, a firewall, a dead host)."""


class StoreServer:
    """The rendezvous TCPStore a receiver hosts, and the address it listens on.

    With no `ports` the OS picks a free port: no race with other listeners. With a
    range (`--kv-ports`, for a firewall or a NetworkPolicy that opens only those), the
    first free port of it from a random start. The store carries only rendezvous keys,
    never KV data.
    """

    def __init__(self, host: str = "127.0.0.1", ports: tuple[int, int] | None = None) -> None:
        if ports is None:
            candidates = [0]
        else:
            low, high = ports
            count = high - low + 1
            start = random.randrange(count)  # channels opened together try different ports first
            candidates = [low + (start + i) % count for i in range(count)]
        for port in candidates:
            try:
                # No world size and no waiting for workers: it outlives any number of joins,
                # and each channel checks for its own peer under its own prefix.
                self.store = dist.TCPStore(
                    host, port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
                )
                break
            except dist.DistNetworkError as error:
                if ports is None or "EADDRINUSE" not in str(error):
                    raise
        else:
            raise OSError(f"no free port for a KV rendezvous in --kv-ports {ports[0]}-{ports[1]}: "
                          f"{len(candidates)} ports, all in use")
        self.host = host
        self.port = self.store.port

    def __repr__(self) -> str:
        return f"StoreServer({self.host}:{self.port})"


def join_group(
    channel_id: str,
    host: str,
    port: int,
    rank: int,
    device: torch.device,
    timeout_s: float,
    secret: bytes,
    agree: dict[str, str],
    cancelled: threading.Event | None = None,
) -> tuple[dist.ProcessGroup, dist.Store]:
    """Build this rank's half of the group and wait for the peer's; (group, prefixed store).

    `secret`: the channel's, which the peer must prove it holds (ValueError if it does
    not). `agree`: settings both sides must share; ValueError naming those that differ.
    `cancelled`: set from another thread, a wait for a peer that has not come yet ends
    (RendezvousCancelled). Raises RuntimeError / OSError on a store or rendezvous timeout
    or a refused connection.
    """
    check_secret(secret)
    timeout = datetime.timedelta(seconds=timeout_s)
    # A client connection of our own (also on the hosting side), so the store's
    # timeout is this channel's.
    try:
        client = dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as error:  # DistNetworkError, DistStoreError: nothing answered there
        raise StoreUnreachableError(f"no rendezvous store answered at {host}:{port}: {error}") from error
    store = dist.PrefixStore(f"{channel_id}/", client)
    # Backends wait for the peer inside their constructors, where nothing can stop them:
    # so first meet it here, where a cancel can.
    store.set(f"present/{rank}", b"1")
    _await_peer(store, f"present/{1 - rank}", timeout_s, cancelled)
    if device.type == "cuda":
        group = _nccl_group(store, rank, device, timeout_s)
    else:
        group = _gloo_group(store, rank, host, port, timeout)
    # Gloo's constructor already met the peer; NCCL connects lazily on the first
    # message. Either way, return only once both ranks are here.
    for key, value in agree.items():
        store.set(f"{key}/{rank}", value)
    store.set(f"joined/{rank}", b"1")
    store.wait([f"joined/{1 - rank}"], timeout)
    theirs = {key: store.get(f"{key}/{1 - rank}").decode() for key in agree}
    differ = [f"{key} {agree[key]} != {value}" for key, value in theirs.items() if value != agree[key]]
    if differ:
        abort_group(group)
        raise ValueError("the two sides of the channel differ: " + ", ".join(differ))
    try:
        proved = _exchange_proofs(group, channel_id, rank, device, secret, timeout_s)
    except BaseException:
        abort_group(group)
        raise
    if not proved:
        abort_group(group)
        raise ValueError("the peer that joined does not hold the channel's secret: refused")
    return group, store


def _await_peer(store: dist.Store, key: str, timeout_s: float, cancelled: threading.Event | None) -> None:
    """Return once `key` is in the store; TimeoutError after `timeout_s`, RendezvousCancelled
    once `cancelled` is set. Looks (store.check: no wait on the store's side, which would log
    a warning each time it ended empty) at growing intervals."""
    deadline = time.monotonic() + timeout_s
    pause = PEER_POLL_S[0]
    while not store.check([key]):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the peer did not reach the rendezvous within {timeout_s:g} s")
        if cancelled is None:
            time.sleep(min(pause, left))
        elif cancelled.wait(min(pause, left)):
            raise RendezvousCancelled("the rendezvous was cancelled before the peer came")
        pause = min(2 * pause, PEER_POLL_S[1])


def _exchange_proofs(group: dist.ProcessGroup, channel_id: str, rank: int, device: torch.device,
                     secret: bytes, timeout_s: float) -> bool:
    """Send our proof over the group, receive the peer's; whether it is right. Runs
    before any transfer, so tag 0 is free; both messages are waited, so none is left
    posted either way. The sender sends first and the receiver receives first, the
    order NCCL's in-order streams need."""
    comm = device if device.type == "cuda" else torch.device("cpu")
    mine = torch.frombuffer(bytearray(channel_proof(secret, channel_id, rank)), dtype=torch.uint8).to(comm)
    theirs = torch.zeros(PROOF_BYTES, dtype=torch.uint8, device=comm)
    if rank == 0:
        works = [group.send([mine], 1, 0), group.recv([theirs], 1, 0)]
    else:
        works = [group.recv([theirs], 0, 0), group.send([mine], 0, 0)]
    for work in works:
        _wait(work, device, timeout_s)
    return is_proof(bytes(theirs.cpu().tolist()), secret, channel_id, 1 - rank)


def _wait(work, device: torch.device, timeout_s: float) -> None:
    if device.type != "cuda":
        work.wait(datetime.timedelta(seconds=timeout_s))
        return
    deadline = time.monotonic() + timeout_s  # NCCL's wait() only orders streams
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no proof from the peer within {timeout_s:g} s")
        time.sleep(50e-6)
    work.wait()


def abort_group(group: dist.ProcessGroup) -> None:
    """Best effort before dropping a group: NCCL aborts its communicators (its pending work
    fails). For Gloo it changes nothing; dropping the group closes its connections."""
    with contextlib.suppress(AttributeError, RuntimeError):
        group.abort()


def _gloo_group(store: dist.Store, rank: int, host: str, port: int, timeout: datetime.timedelta):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    if rank == 1 and host in ("", "0.0.0.0", "::"):
        device = dist.ProcessGroupGloo.create_default_device()  # a wildcard is no address to publish
    else:
        device = dist.ProcessGroupGloo.create_device(hostname=_local_address(host, port, rank))
    options._devices = [device]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _local_address(host: str, port: int, rank: int) -> str:
    """The local address to bind Gloo's socket to: one the peer can reach.

    The receiver binds where it hosts the store (the address it advertised); the
    sender asks the routing table which local address reaches that host (a UDP
    connect sends nothing). Gloo's default, a lookup of our hostname, can resolve
    to a loopback alias that a remote peer cannot reach.
    """
    if rank == 1:
        return host
    return source_address(host, port)


def _nccl_group(store: dist.Store, rank: int, device: torch.device, timeout_s: float):
    # NOTE: not exercised by the CPU-only tests. The device must be current before NCCL
    # creates its communicator (on the first message); transfers also run under
    # torch.cuda.device(device), since executor threads start on device 0.
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    # The channel times its waits out itself and aborts the group. NCCL's watchdog,
    # which tears the whole process down when its own timeout fires, must never fire first.
    options._timeout = datetime.timedelta(seconds=max(600.0, 10 * timeout_s))
    return dist.ProcessGroupNCCL(store, rank, 2, options)
