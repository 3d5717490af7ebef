"""Plain-torch paged attention (CPU reference and fallback).

Per layer the work is a handful of ops, independent of the number of decode
sequences: one index_copy_ per cache for the writes, one gather and one
scaled_dot_product_attention for the whole decode group, and per prefill chunk
(few, large) one gather and one scaled_dot_product_attention.

Gathers copy whole blocks into two scratch buffers allocated once per forward
and reused by every layer: on CPU a fresh multi-MB tensor per gather costs as
much again in page faults as the copy itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionBatch


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """What one prefill chunk needs in every layer."""

    token_start: int
    token_end: int
    context_len: int
    # [num_blocks] int64, the chunk's blocks; None when nothing was cached before
    # the chunk, so it attends over its own new K/V without a gather.
    block_ids: torch.Tensor | None
    # [q, context_len] bool, True = attend; None when no mask is needed
    # (q == 1 sees the whole context; a chunk without prefix uses is_causal).
    mask: torch.Tensor | None

    @property
    def is_causal(self) -> bool:
        return self.block_ids is None and self.token_end - self.token_start > 1


@dataclass(frozen=True, slots=True)
class TorchAttentionMetadata:
    """Index tensors and masks shared by all layers of one forward pass."""

    slot_mapping: torch.Tensor  # [N] int64
    num_decode_tokens: int  # D
    decode_block_ids: torch.Tensor  # [D * MB] int64, row-major block table cut to MB columns
    decode_mask: torch.Tensor  # [D, 1, 1, MB * block_size] bool, True = position < seq_len
    prefills: tuple[PrefillPlan, ...]
    # [max blocks gathered at once, block_size * KvH * Dh] each: gather destinations
    key_scratch: torch.Tensor
    value_scratch: torch.Tensor


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with torch ops; exact in float64, float32 softmax for bfloat16.

    GQA without repeating K/V: for a decode, the G query heads that share a KV
    head are laid out as G query rows of that head, so one sdpa call over
    [D, KvH, G, Dh] x [D, KvH, L, Dh] covers the whole group.
    """

    name = "torch"

    def build_metadata(
        self,
        batch: AttentionBatch,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> TorchAttentionMetadata:
        device = batch.slot_mapping.device
        num_decodes = batch.num_decode_tokens
        max_blocks = math.ceil(batch.decode_max_seq_len / block_size)
        decode_block_ids = batch.decode_block_tables[:, :max_blocks].reshape(-1)
        positions = torch.arange(max_blocks * block_size, device=device)
        decode_mask = positions[None, :] < batch.decode_seq_lens[:, None]  # [D, L]
        decode_mask = decode_mask.view(num_decodes, 1, 1, max_blocks * block_size)

        plans = []
        max_gathered_blocks = decode_block_ids.shape[0]
        for chunk in batch.prefills:
            num_cached = chunk.context_len - chunk.num_tokens
            mask = None
            if num_cached and chunk.num_tokens > 1:
                key_positions = torch.arange(chunk.context_len, device=device)
                query_positions = torch.arange(num_cached, chunk.context_len, device=device)
                mask = key_positions[None, :] <= query_positions[:, None]  # [q, C]
            if num_cached:
                max_gathered_blocks = max(max_gathered_blocks, chunk.block_ids.shape[0])
            plans.append(
                PrefillPlan(
                    token_start=chunk.token_start,
                    token_end=chunk.token_start + chunk.num_tokens,
                    context_len=chunk.context_len,
                    block_ids=chunk.block_ids if num_cached else None,
                    mask=mask,
                )
            )
        scratch_shape = (max_gathered_blocks, block_size * num_kv_heads * head_dim)
        return TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            num_decode_tokens=num_decodes,
            decode_block_ids=decode_block_ids,
            decode_mask=decode_mask,
            prefills=tuple(plans),
            key_scratch=torch.empty(scratch_shape, dtype=dtype, device=device),
            value_scratch=torch.empty(scratch_shape, dtype=dtype, device=device),
        )

    def forward(
        self,
        query: torch.Tensor,  # [N, H, Dh]
        key: torch.Tensor,  # [N, KvH, Dh]
        value: torch.Tensor,  # [N, KvH, Dh]
        key_cache: torch.Tensor,  # [num_blocks, block_size, KvH, Dh]
        value_cache: torch.Tensor,  # [num_blocks, block_size, KvH, Dh]
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [N, H, Dh]
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)

        outputs = []
        # NOTE: each attention call below finishes reading the scratch buffers
        # before the next gather overwrites them.
        if metadata.num_decode_tokens:
            outputs.append(self._decode(query, key_cache, value_cache, metadata, scale))
        for plan in metadata.prefills:
            outputs.append(
                self._prefill(query, key, value, key_cache, value_cache, metadata, plan, scale)
            )
        return outputs[0].contiguous() if len(outputs) == 1 else torch.cat(outputs)

    @staticmethod
    def _decode(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [D, H, Dh]
        num_decodes = metadata.num_decode_tokens
        _, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[2]
        group = num_heads // num_kv_heads
        keys = _gather(key_cache, metadata.decode_block_ids, metadata.key_scratch)  # [D * L, KvH, Dh]
        values = _gather(value_cache, metadata.decode_block_ids, metadata.value_scratch)
        keys = keys.view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)  # [D, KvH, L, Dh]
        values = values.view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
        grouped_query = query[:num_decodes].reshape(num_decodes, num_kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(
            grouped_query, keys, values, attn_mask=metadata.decode_mask, scale=scale
        )  # [D, KvH, G, Dh]
        return out.view(num_decodes, num_heads, head_dim)

    @staticmethod
    def _prefill(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        plan: PrefillPlan,
        scale: float,
    ) -> torch.Tensor:  # [q, H, Dh]
        start, end = plan.token_start, plan.token_end
        if plan.block_ids is None:
            keys, values = key[start:end], value[start:end]  # [q, KvH, Dh]
        else:
            keys = _gather(key_cache, plan.block_ids, metadata.key_scratch)[: plan.context_len]
            values = _gather(value_cache, plan.block_ids, metadata.value_scratch)[: plan.context_len]
            # keys, values: [C, KvH, Dh]
        out = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1),  # [H, q, Dh]
            keys.transpose(0, 1),  # [KvH, C, Dh]
            values.transpose(0, 1),
            attn_mask=plan.mask,
            is_causal=plan.is_causal,
            scale=scale,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # [H, q, Dh]
        return out.transpose(0, 1)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Blocks `block_ids` of `cache` copied into `scratch`: [len(block_ids) * block_size, KvH, Dh].

    index_select on the 2-D view copies whole blocks as rows, several times
    faster than indexing the 4-D cache.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = scratch[: block_ids.shape[0]]
    torch.index_select(cache.view(num_blocks, -1), 0, block_ids, out=rows)
    return rows.view(-1, num_kv_heads, head_dim)
