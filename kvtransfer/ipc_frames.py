"""The ipc transport's control frames (ipc.py): one message per frame over a Unix
SOCK_SEQPACKET socket, a kind byte then its payload, file descriptors alongside
(SCM_RIGHTS) where a frame hands over memory."""

from __future__ import annotations

import array
import contextlib
import os
import select
import socket
import struct
from collections.abc import Sequence

from kvtransfer.transport import KvTransferError

HELLO, WELCOME, READY, HEADER, GO, DONE, REFUSE, ABORT, ABORTED = range(1, 10)
_FRAME_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", READY: "READY", HEADER: "HEADER", GO: "GO", DONE: "DONE",
                REFUSE: "REFUSE", ABORT: "ABORT", ABORTED: "ABORTED"}
MAX_FRAME_BYTES = 64 << 10

class PeerGone(KvTransferError):
    """The peer closed the socket: it exited (or was killed), or closed the channel."""


class Frames:
    """Control frames over the channel's socket: a kind byte and a payload per message."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s

    def send(self, kind: int, payload: bytes = b"", fds: Sequence[int] = ()) -> None:
        self.sock.settimeout(self.timeout_s)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            self.sock.sendmsg([bytes([kind]) + payload], ancillary)
        except (BrokenPipeError, ConnectionResetError) as error:
            raise PeerGone(f"the peer is gone ({type(error).__name__})") from None

    def recv(self, *expected: int, timeout_s: float | None = None) -> tuple[int, bytes, list[int]]:
        """The next frame, of one of the `expected` kinds (REFUSE is always accepted).
        _PeerGone on EOF, TimeoutError after the timeout, ValueError on a frame out of turn."""
        self.sock.settimeout(self.timeout_s if timeout_s is None else timeout_s)
        try:
            data, ancillary, flags, _ = self.sock.recvmsg(MAX_FRAME_BYTES, socket.CMSG_SPACE(4 * 4))
        except socket.timeout:
            raise TimeoutError(f"no answer from the peer within {self.sock.gettimeout():g} s") from None
        except ConnectionResetError:
            raise PeerGone("the peer is gone (connection reset)") from None
        fds = []
        for level, kind, body in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", body[: len(body) - len(body) % 4]))
        if not data:
            close_fds(fds)
            raise PeerGone("the peer is gone (its end of the socket closed)")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            close_fds(fds)
            raise ValueError("a control frame too large")
        kind, payload = data[0], data[1:]
        if kind not in expected and kind != REFUSE:
            close_fds(fds)
            wanted = " or ".join(_FRAME_NAMES.get(k, str(k)) for k in expected)
            raise ValueError(f"got a {_FRAME_NAMES.get(kind, kind)} frame where {wanted} was due")
        return kind, payload, fds

    def has_input(self) -> bool:
        """Whether a frame (or EOF) waits to be read; never blocks."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))

    def close(self) -> None:
        self.sock.close()


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def tag_bytes(tag: int) -> bytes:
    return struct.pack("<Q", tag)


def tag_of(payload: bytes) -> int:
    return struct.unpack("<Q", payload[:8])[0]
