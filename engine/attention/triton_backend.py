"""Paged attention in Triton kernels (engine/kernels/triton_attention.py, triton_ops.py).

Per layer, two launches whatever the batch holds:

1. `rope_and_store_kv`: rotates q and k of the fused qkv projection in place
   and writes k and v into the cache at the batch's slots;
2. `paged_attention`: every sequence of the flattened batch, decodes and
   prefill chunks alike, attends to its keys in the cache (the chunk's own
   keys were stored by step 1), causally, in one launch. A decode-only step
   whose (sequence, KV head) programs are too few to fill the GPU splits each
   context across programs and reduces the parts (flash-decoding).

The default backend on CUDA. On CPU it runs under Triton's interpreter
(TRITON_INTERPRET=1, set by `get_attention_backend` before the kernels are
imported): slow, but the same kernels, which is how CI tests them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionBatch
from engine.attention.torch_backend import slot_view
from engine.kernels.triton_attention import choose_num_splits, choose_static_num_splits, paged_attention
from engine.kernels.triton_ops import rope_and_store_kv


@dataclass(frozen=True, slots=True)
class TritonAttentionMetadata:
    """What every layer's launches share in one forward pass."""

    slot_mapping: torch.Tensor  # [N] int64
    query_start: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    max_query_len: int
    max_seq_len: int
    num_splits: int  # > 1 only for decode-only steps
    table_stride: torch.Tensor | None  # static batches: block_tables' row stride, on the device


class TritonAttentionBackend(AttentionBackend):
    """Paged attention and the fused RoPE + KV store as Triton kernels."""

    name = "triton"
    fuses_rope = True
    supports_static_batches = True

    def __init__(self, device: torch.device | str = "cuda") -> None:
        device = torch.device(device)
        # Splitting contexts only pays when programs are too few for the SMs; the
        # interpreter runs one program at a time.
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        )

    def num_decode_splits(self, num_seqs: int, num_kv_heads: int, max_seq_len: int, *, is_static: bool) -> int:
        """Parts each context of a decode-only batch is split into on this device. A static
        batch (engine/runner/decode_graphs.py) gets few distinct counts (`choose_static_num_splits`):
        each is a CUDA graph of its own."""
        choose = choose_static_num_splits if is_static else choose_num_splits
        return choose(num_seqs, num_kv_heads, max_seq_len, self.num_sms)

    def build_metadata(
        self,
        batch: AttentionBatch,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> TritonAttentionMetadata:
        num_splits = 1
        if batch.max_query_len == 1:
            # NOTE: a static batch's max_seq_len is the longest context its launches serve.
            num_splits = self.num_decode_splits(batch.num_seqs, num_kv_heads, batch.max_seq_len,
                                                is_static=batch.table_stride is not None)
        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            query_start=batch.query_start,
            seq_lens=batch.seq_lens,
            block_tables=batch.block_tables,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            num_splits=num_splits,
            table_stride=batch.table_stride,
        )

    def forward_rotary(
        self,
        qkv: torch.Tensor,  # [N, H + 2 * KvH, Dh], q and k rotated here in place
        cos: torch.Tensor,  # [N, Dh]
        sin: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, KvH, Dh]
        value_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        num_heads: int,
        scale: float,
    ) -> torch.Tensor:  # [N, H, Dh]
        num_kv_heads = (qkv.shape[1] - num_heads) // 2
        rope_and_store_kv(
            qkv, cos, sin, key_cache, value_cache, metadata.slot_mapping, num_heads, num_kv_heads
        )
        return self._attend(qkv[:, :num_heads], key_cache, value_cache, metadata, scale)

    def forward(
        self,
        query: torch.Tensor,  # [N, H, Dh]
        key: torch.Tensor,  # [N, KvH, Dh]
        value: torch.Tensor,  # [N, KvH, Dh]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [N, H, Dh]
        """For callers that rotated q and k already: store k and v with torch, then attend."""
        for cache, new in ((key_cache, key), (value_cache, value)):
            slot_rows, rows = slot_view(cache, metadata.slot_mapping)
            slot_rows.index_copy_(0, rows, new)
        return self._attend(query, key_cache, value_cache, metadata, scale)

    @staticmethod
    def _attend(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        paged_attention(
            query,
            key_cache,
            value_cache,
            out,
            metadata.query_start,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            num_splits=metadata.num_splits,
            table_stride=metadata.table_stride,
        )
        return out
