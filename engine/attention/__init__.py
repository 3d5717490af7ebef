"""Paged attention: the batch layout (`AttentionBatch`), the backend contract and its registry."""

from __future__ import annotations

from engine.attention.base import (
    AttentionBackend,
    AttentionBatch,
    PrefillChunk,
    SequenceSpan,
    build_attention_batch,
)

ATTENTION_BACKENDS = ("torch",)


def get_attention_backend(name: str) -> AttentionBackend:
    """The attention backend called `name`; its implementation is imported on demand."""
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
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
