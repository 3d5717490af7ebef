"""Process state: the one module of engine/ that reads or sets environment variables.

Nothing here runs at import. A process that serves a model calls
`configure_process` once, at its entry point (LLM(...) does it for the offline
API; the workers do it in their main).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection


def configure_process(num_threads: int | None = None, cpus: Collection[int] = ()) -> None:
    """Call once at a process's entry point, before the model loads.

    Sets THP_MEM_ALLOC_ENABLE=1 and TORCH_NCCL_ASYNC_ERROR_HANDLING=2 unless the
    environment already sets them; with `cpus`,
    binds the process (every thread it has, and so every thread it starts later:
    torch's, OpenMP's, gRPC's) to those cores; with `num_threads`, torch's intra-op
    thread count.
    """
    if num_threads is not None and num_threads <= 0:
        raise ValueError("num_threads must be positive")
    if cpus:
        bind_to_cpus(cpus)
    # Back torch's large CPU allocations (KV cache, weights) with transparent huge
    # pages where the kernel allows it on request: decode steps stream the weights
    # and hop between scattered KV blocks, and 2 MB pages cut their TLB misses
    # (the gain measured: docs/operations.md). torch reads the variable
    # at its first large allocation; set THP_MEM_ALLOC_ENABLE=0 to opt out.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # A KV channel over NCCL whose peer dies, or aborts the group on its timeout, must
    # fail that channel, not this process: NCCL's watchdog tears the process down on an
    # asynchronous error by default (3), while 2 only aborts the communicator. Read
    # when a group is made; set the variable to choose otherwise.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)


def bind_to_cpus(cpus: Collection[int]) -> None:
    """Run this process's threads, those it has and those it starts, on `cpus` only (Linux).

    Two workers on one host that share its cores slow each other beyond their share:
    an OpenMP parallel region waits at its barrier for whichever of its threads the
    other worker's threads displaced. Disjoint cores make each worker behave as if it
    had a host of its own (vLLM's CPU backend binds its threads the same way).
    """
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def native_arch() -> str:
    """The -march the CPU kernels are built for: BATON_NATIVE_ARCH, else the building machine's."""
    return os.environ.get("BATON_NATIVE_ARCH", "native")


# The Triton kernel modules: their @triton.jit decorators read TRITON_INTERPRET at import.
_TRITON_KERNEL_MODULES = ("engine.kernels.triton_lang", "engine.kernels.triton_attention", "engine.kernels.triton_ops",
                          "engine.kernels.triton_fp8", "engine.kernels.triton_moe")


def use_triton_interpreter() -> None:
    """Run Baton's Triton kernels on CPU tensors through Triton's interpreter (slow,
    exact): sets TRITON_INTERPRET=1, which must happen before the kernels are imported."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    imported = [name for name in _TRITON_KERNEL_MODULES if name in sys.modules]
    if imported:
        raise RuntimeError(
            "the Triton kernels were imported for a GPU in this process; they run on CPU "
            "tensors only when TRITON_INTERPRET=1 is set before that"
        )
    os.environ["TRITON_INTERPRET"] = "1"
