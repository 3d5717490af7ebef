"""CPU attention with a native paged decode kernel (engine/kernels/cpu_attention.cpp).

Decodes, the bulk of attention time in serving, run in one kernel call per
layer that reads every sequence's keys and values straight from its KV blocks:
no gather into a padded copy, no mask, each position read once. Prefill chunks
are compute-bound matmuls and stay on the torch path of `TorchAttentionBackend`.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBatch
from engine.attention.torch_backend import DecodeGroup, TorchAttentionBackend, TorchAttentionMetadata
from engine.kernels import load_cpu_kernels, paged_decode_attention


class CpuAttentionBackend(TorchAttentionBackend):
    """TorchAttentionBackend with decodes in the native kernel; builds the kernel on first use."""

    name = "cpu"

    def __init__(self) -> None:
        load_cpu_kernels()

    @staticmethod
    def _plan_decodes(batch: AttentionBatch, block_size: int) -> tuple[DecodeGroup, ...]:
        return ()  # the kernel walks the block tables itself

    @staticmethod
    def _decode(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        num_decodes = metadata.num_decode_tokens
        paged_decode_attention(
            query[:num_decodes],
            key_cache,
            value_cache,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            scale,
            out[:num_decodes],
        )
