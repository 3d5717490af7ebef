"""Paged attention: the batch layout (`AttentionBatch`), the backend contract and its registry."""

from __future__ import annotations

from engine.attention.base import (
    AttentionBackend,
    AttentionBatch,
    PrefillChunk,
    SequenceSpan,
    build_attention_batch,
)

import torch

from engine.config import ATTENTION_BACKENDS


def get_attention_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """The attention backend called `name`; its implementation is imported on demand."""
    if name == "auto":
        from engine.kernels import cpu_kernels_available

        use_cpu = torch.device(device).type == "cpu" and cpu_kernels_available()
        name = "cpu" if use_cpu else "torch"
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
