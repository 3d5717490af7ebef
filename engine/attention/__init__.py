"""Paged attention: the batch layout (`AttentionBatch`), the backend contract and its registry."""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import (
    AttentionBackend,
    AttentionBatch,
    PrefillChunk,
    SequenceSpan,
    build_attention_batch,
)
from engine.config import ATTENTION_BACKENDS


def get_attention_backend(
    name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    """The attention backend called `name` for `dtype` tensors on `device`; its
    implementation is imported on demand. "auto" is "triton" on CUDA (except for
    float64), else "cpu" where the native kernels build and have the dtype, else "torch"."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            # float64 (exact parity runs) has no tensor-core dots: the torch backend.
            name = "torch" if dtype == torch.float64 else "triton"
        else:
            from engine.kernels import CPU_KERNEL_DTYPES, cpu_kernels_available

            name = "cpu" if dtype in CPU_KERNEL_DTYPES and cpu_kernels_available() else "torch"
    if name == "triton":
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"the triton attention backend runs float32, float16 and bfloat16, not {dtype}")
        if importlib.util.find_spec("triton") is None:
            raise ImportError("the triton attention backend needs Triton: pip install 'baton[gpu]'")
        if device.type == "cpu":
            from engine.envs import use_triton_interpreter

            use_triton_interpreter()
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on CPU tensors, not {device}")
    if name == "cpu":
        from engine.kernels import CPU_KERNEL_DTYPES

        if dtype not in CPU_KERNEL_DTYPES:
            raise ValueError(f"the cpu attention backend has no {dtype} kernels; use the torch backend")
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}")


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionBatch",
    "PrefillChunk",
    "SequenceSpan",
    "build_attention_batch",
    "get_attention_backend",
]
