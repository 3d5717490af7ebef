"""The CUDA device of the threads that work for an engine.

CUDA's current device is per thread, and every thread starts on device 0. Triton
launches a kernel on the current device, whatever its tensors' device, and torch's
CUDA calls that take no device (streams, events, synchronize) act on it. So each
thread that runs engine or KV-cache work for an engine on `cuda:N` makes `cuda:N`
current before it does anything: the loading thread (LLMEngine), the engine thread
(AsyncEngine), and the KV transfer threads (`device_executor`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device; a CPU device: nothing
    (no call into torch.cuda)."""
    if device.type == "cuda":
        assert device.index is not None, "a thread's device needs an index (cuda:N)"
        torch.cuda.set_device(device)


def engine_device(name: str) -> torch.device:
    """The device an engine is configured on (`--device`), with its index (cuda: the
    current one), made current for the calling (loading) thread. ValueError for CUDA
    on a machine without it."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this machine has no CUDA device torch can use")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        use_device(device)
    return device


def device_executor(device: torch.device, name: str) -> ThreadPoolExecutor:
    """A thread of its own (work submitted runs there in order) that makes `device`
    current as it starts."""
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=use_device, initargs=(device,))
