"""Sharing a KV cache with another process on this host, for the ipc transport (ipc.py):
the receiver exports its cache's blocks (a memfd descriptor, or a CUDA IPC handle as
plain fields: what torch.multiprocessing's reductions send for a CUDA tensor, with no
pickle), the sender maps them as rows it copies into.

Each side does it once per cache, whatever the number of channels between them: the
receiver exports its cache once (a CUDA export takes an IPC event and a ref-counter
slot each time), and the sender maps a receiver's segment once while any channel still
uses it (a mapping of a large cache costs page tables, and the time to build them).

NOTE: a CUDA export writes to the cache: torch's `_share_cuda_` replaces the storage's
data pointer (same address, a ref-counted context). A decode worker therefore exports
its cache at startup, as its engine thread's first command, before anything steps
(decode_worker/server.py); channels offered later reuse that export.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

from engine.kv.cache import KVCache
from engine.kv.shared_memory import SharedMemory
from kvtransfer.endpoint import gpu_uuid
from kvtransfer.layout import KvLayoutSpec
from kvtransfer.transport import KvTransferError
from kvtransfer.wire import wide_rows

# CUDA on one device: a plan of more pieces than this is copied by one copy_rows launch
# (engine/kernels/triton_ops.py); a few long runs stay memcpys, the fastest copy there is.
MAX_MEMCPY_RUNS = 4


# KVCache: (export, fds), or why it cannot be shared (tried once: it never could later).
_exports: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_mappings: dict[tuple, weakref.ref] = {}  # a receiver's segment (device, inode, size, dtype): its rows here
_lock = threading.Lock()


def export_cache(kv_cache: KVCache) -> tuple[dict, list[int]]:
    """What the sender needs to map our cache's blocks, and the descriptors to pass it
    (this process keeps them; the socket sends copies). Exported by the first call, which
    must not race a step (see the NOTE above); later calls return the same. KvTransferError
    if this cache cannot be shared."""
    with _lock:
        exported = _exports.get(kv_cache)
        if exported is None:
            try:
                exported = _export(kv_cache)
            except KvTransferError as error:
                exported = error
            _exports[kv_cache] = exported
    if isinstance(exported, KvTransferError):
        raise KvTransferError(str(exported))
    return exported


def _export(kv_cache: KVCache) -> tuple[dict, list[int]]:
    blocks = kv_cache.blocks
    if blocks.device.type == "cpu":
        memory = kv_cache.shared_memory
        if memory is None or memory.fd is None:
            raise KvTransferError("this worker's KV cache is not in shared memory (an engine built without "
                                  "CacheConfig.shareable): the ipc transport cannot reach it")
        return {"memory": "memfd", "num_bytes": memory.num_bytes}, [memory.fd]
    storage = blocks.untyped_storage()
    # NOTE: torch.multiprocessing's reduce_tensor sends these same fields for a CUDA tensor.
    try:
        (device, handle, storage_bytes, storage_offset_bytes, ref_counter_handle, ref_counter_offset,
         event_handle, event_sync_required) = storage._share_cuda_()
    except RuntimeError as error:  # an allocation CUDA IPC cannot hand out
        raise KvTransferError(f"this worker's KV cache on {blocks.device} cannot be shared: {error}") from error
    return {
        "memory": "cuda",
        "gpu_uuid": gpu_uuid(blocks.device),
        "handle": bytes(handle).hex(),
        "storage_bytes": int(storage_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": bytes(ref_counter_handle).hex(),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event_handle or b"").hex(),
        "event_sync_required": bool(event_sync_required),
        "tensor_offset": blocks.storage_offset(),
    }, []


def map_cache(cache: dict, fds: list[int], spec: KvLayoutSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    """The receiver's cache mapped here, as rows [num_blocks, block row] of its dtype. The
    caller keeps (and closes) `fds`. One mapping per segment while its rows are in use."""
    row = spec.bytes_per_block // spec.element_size
    num_bytes = num_blocks * spec.bytes_per_block
    if cache["memory"] == "memfd":
        if device.type != "cpu":
            raise ValueError("the receiver's cache is in host memory and ours on CUDA")
        if len(fds) != 1:
            raise ValueError(f"expected one descriptor of the receiver's cache, got {len(fds)}")
        if int(cache["num_bytes"]) != num_bytes:
            raise ValueError(f"the receiver's cache has {cache['num_bytes']} bytes, not {num_bytes}")
        stat = os.fstat(fds[0])
        key = (stat.st_dev, stat.st_ino, num_bytes, spec.dtype, num_blocks)
        with _lock:
            for stale in [k for k, ref in _mappings.items() if ref() is None]:
                del _mappings[stale]
            rows = _mappings[key]() if key in _mappings else None
            if rows is None:
                memory = SharedMemory.attach(os.dup(fds[0]), num_bytes)
                rows = memory.tensor(spec.torch_dtype).view(num_blocks, row)
                _mappings[key] = weakref.ref(rows)
        return rows
    if cache["memory"] != "cuda" or device.type != "cuda":
        raise ValueError(f"cannot map a receiver's cache in {cache['memory']!r} memory from {device}")
    index = _local_gpu(cache["gpu_uuid"])
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        bytes.fromhex(cache["handle"]),
        int(cache["storage_bytes"]),
        int(cache["storage_offset_bytes"]),
        bytes.fromhex(cache["ref_counter_handle"]),
        int(cache["ref_counter_offset"]),
        bytes.fromhex(cache["event_handle"]),
        bool(cache["event_sync_required"]),
    )
    if storage.nbytes() < (int(cache["tensor_offset"]) + num_blocks * row) * spec.element_size:
        raise ValueError("the receiver's CUDA allocation is smaller than its cache")
    rows = torch.empty(0, dtype=spec.torch_dtype, device=torch.device("cuda", index))
    return rows.set_(storage, int(cache["tensor_offset"]), (num_blocks, row), (row, 1))


def _local_gpu(uuid: str) -> int:
    """This process's index of the GPU with `uuid`; ValueError if it does not see it."""
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", index)) == uuid:
            return index
    raise ValueError(f"the receiver's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)")


def compile_copy_rows(rows: torch.Tensor) -> None:
    """Compile copy_rows for these rows now, between two scratch rows of their shape,
    rather than on the first transfer's critical path."""
    from engine.kernels.triton_ops import copy_rows

    scratch = torch.zeros(2, *wide_rows(rows).shape[1:], dtype=wide_rows(rows).dtype, device=rows.device)
    ids = torch.tensor([0], dtype=torch.long, device=rows.device)
    copy_rows(scratch, scratch, ids, ids + 1)
    torch.cuda.current_stream(rows.device).synchronize()


def copies_in_one_launch(plan) -> bool:
    """CUDA, same device: whether one copy_rows launch beats the plan's memcpys (runs) and
    gathers (staged blocks): any plan of more than a few pieces."""
    return len(plan.runs) + (1 if plan.staged else 0) > MAX_MEMCPY_RUNS


def copy_rows_on_device(rows: torch.Tensor, peer: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
    """peer[dst_ids[i]] = rows[src_ids[i]] in one copy_rows launch on the current stream
    (both on one CUDA device; Triton is imported only here, where CUDA is)."""
    from engine.kernels.triton_ops import copy_rows

    copy_rows(wide_rows(rows), wide_rows(peer), index_on(src_ids, rows.device), index_on(dst_ids, rows.device))


def index_on(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index on `device`, copied from pinned memory without a host wait."""
    if device.type != "cuda":
        return torch.tensor(ids, dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)
