"""Host memory another process on this host can map: an anonymous shared-memory file
(memfd), handed to the other process as a file descriptor (kvtransfer passes it over a
Unix socket), never by a name.

A segment with a name in /dev/shm outlives a process killed with SIGKILL unless
something else removes it, and /dev/shm is often small in containers (64 MB by
default in Docker). A memfd has neither problem: it has no name to leave behind, its
pages are freed when the last descriptor and mapping are gone, whoever dies first,
and it is charged to the process's memory like any allocation.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch


class SharedMemory:
    """One memfd segment of `num_bytes`, mapped read-write in this process.

    `tensor(dtype)` views it (page-aligned, zero-filled when created). The mapping
    lives as long as this object or any tensor viewing it (each holds the map), so no
    view can outlive it. `fd` is what another process maps, through
    `SharedMemory.attach(fd, num_bytes)`.
    """

    def __init__(self, num_bytes: int, name: str = "baton", *, _fd: int | None = None) -> None:
        if num_bytes <= 0:
            raise ValueError(f"a shared segment needs a positive size, got {num_bytes}")
        self.num_bytes = num_bytes
        attached = _fd is not None
        if _fd is None:
            # Close-on-exec: children of this process do not inherit it; a peer gets a
            # descriptor of its own over a socket.
            _fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            if attached:
                if os.fstat(_fd).st_size < num_bytes:
                    raise ValueError(f"the shared segment is smaller than the {num_bytes} bytes expected")
            else:
                os.ftruncate(_fd, num_bytes)
            # NOTE: no MAP_POPULATE for an attached segment: mapping every page of a cache of
            # tens of GB at once would take longer than a channel may take to open. A page is
            # mapped at its first copy, once per process (kvtransfer keeps one mapping).
            self._map = mmap.mmap(_fd, num_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # before the pages exist; taken where the host allows it
                with contextlib.suppress(OSError):
                    self._map.madvise(mmap.MADV_HUGEPAGE)
            if not attached:
                # Allocate every page now rather than at its first touch: a segment the host
                # cannot back then fails here, at start (ENOSPC), or meets the memory
                # limit here, instead of in the middle of serving.
                os.posix_fallocate(_fd, 0, num_bytes)
        except BaseException:
            os.close(_fd)
            raise
        # A mapping does not need its descriptor: an attached segment keeps none.
        self.fd: int | None = _fd
        if attached:
            os.close(_fd)
            self.fd = None

    @classmethod
    def attach(cls, fd: int, num_bytes: int) -> SharedMemory:
        """Map a segment another process made, from a descriptor of it (which this takes
        over and closes). ValueError if the segment is smaller than `num_bytes`."""
        return cls(num_bytes, _fd=fd)

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole segment as a flat tensor of `dtype` (no copy; it keeps the mapping alive)."""
        return torch.frombuffer(self._map, dtype=torch.uint8, count=self.num_bytes).view(dtype)

    def close(self) -> None:
        """Close the descriptor (the segment can no longer be shared from here); idempotent.
        The mapping goes with the last reference to this object and its tensors."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
