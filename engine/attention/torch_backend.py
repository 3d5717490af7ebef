"""Plain-torch paged attention (the CPU backend, and the reference for others).

Per layer: one index_copy_ per cache writes the step's K/V; then

- decodes, in groups of sequences of similar length (sorted once per step),
  one gather + one scaled_dot_product_attention per group. Sorting keeps the
  padding of each group's gathered K/V small, and the query layout below keeps
  SDPA on its fused CPU kernel;
- each prefill chunk, one scaled_dot_product_attention over the chunk's
  keys (its cached prefix, gathered, plus its own), GQA-aware
  (`enable_gqa`, K/V never repeated): `is_causal` when nothing is cached
  before the chunk, else an additive causal mask offset by the prefix, built
  once per forward and shared by the layers.

GQA for decodes without repeating K/V: the G query heads that share a KV head
are laid out as G query rows of that head (`[KvH, G, Dh]`), so one call covers them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionBatch

# Decode sequences per gather/SDPA call once the group is split by length.
DECODE_GROUP_SIZE = 8


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Decode sequences attended together (rows of the decode group, by length)."""

    rows: torch.Tensor | None  # [d] int64 rows of the decode group; None = all, in order
    block_ids: torch.Tensor  # [d * MB] int64, their block tables cut to MB columns
    mask: torch.Tensor  # [d, 1, 1, MB * block_size] bool, True = position < seq_len


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """What one prefill chunk needs in every layer."""

    token_start: int
    token_end: int
    context_len: int
    # [num_blocks] int64, the chunk's blocks; None when nothing was cached before
    # the chunk, so it attends over its own new K/V without a gather or a mask.
    block_ids: torch.Tensor | None
    # [q, context_len] additive mask (0 = attend, -inf = future) when a prefix
    # is cached; None means plain causal attention over the chunk itself.
    bias: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class TorchAttentionMetadata:
    """Index tensors and masks shared by all layers of one forward pass."""

    slot_mapping: torch.Tensor  # [N] int64
    num_decode_tokens: int  # D
    decode_block_tables: torch.Tensor  # [D, max_blocks] int64 (the batch's)
    decode_seq_lens: torch.Tensor  # [D] int64 (the batch's)
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillPlan, ...]
    # [max blocks gathered at once, block_size * KvH * Dh] each: gather destinations,
    # allocated once per forward (fresh multi-MB tensors per layer cost page faults).
    key_scratch: torch.Tensor
    value_scratch: torch.Tensor
    # Block stride of the caches (elements) -> slot_mapping as rows of the caches'
    # flat slot view (slot_view); filled by the first layer, reused by the others.
    slot_rows: dict[int, torch.Tensor] = field(default_factory=dict)


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with torch ops; exact in float64, float32 softmax for bfloat16."""

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
        groups = self._plan_decodes(batch, block_size)
        max_gathered_blocks = max((g.block_ids.shape[0] for g in groups), default=0)

        plans = []
        for chunk in batch.prefills:
            num_cached = chunk.context_len - chunk.num_tokens
            if num_cached:
                max_gathered_blocks = max(max_gathered_blocks, chunk.block_ids.shape[0])
            plans.append(
                PrefillPlan(
                    token_start=chunk.token_start,
                    token_end=chunk.token_start + chunk.num_tokens,
                    context_len=chunk.context_len,
                    block_ids=chunk.block_ids if num_cached else None,
                    bias=_prefix_causal_bias(chunk.num_tokens, num_cached, dtype, device) if num_cached else None,
                )
            )
        scratch_shape = (max_gathered_blocks, block_size * num_kv_heads * head_dim)
        return TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            num_decode_tokens=batch.num_decode_tokens,
            decode_block_tables=batch.decode_block_tables,
            decode_seq_lens=batch.decode_seq_lens,
            decode_groups=groups,
            prefills=tuple(plans),
            key_scratch=torch.empty(scratch_shape, dtype=dtype, device=device),
            value_scratch=torch.empty(scratch_shape, dtype=dtype, device=device),
        )

    @staticmethod
    def _plan_decodes(batch: AttentionBatch, block_size: int) -> tuple[DecodeGroup, ...]:
        return _decode_groups(batch, block_size)

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
        if key_cache.stride() != value_cache.stride():
            raise ValueError("key and value caches differ in strides")
        key_slots, rows = _slot_view(key_cache, metadata)
        key_slots.index_copy_(0, rows, key)
        _slot_view(value_cache, metadata)[0].index_copy_(0, rows, value)

        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        # NOTE: each attention call below finishes reading the scratch buffers
        # before the next gather overwrites them.
        if metadata.num_decode_tokens:
            self._decode(query, key_cache, value_cache, metadata, scale, out)
        for plan in metadata.prefills:
            self._prefill(query, key, value, key_cache, value_cache, metadata, plan, scale, out)
        return out

    @staticmethod
    def _decode(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [N, H, Dh], rows [0, D) written here
    ) -> None:
        num_decodes = metadata.num_decode_tokens
        _, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[2]
        group_size = num_heads // num_kv_heads
        grouped_query = query[:num_decodes].reshape(num_decodes, num_kv_heads, group_size, head_dim)
        grouped_out = out[:num_decodes].view(num_decodes, num_kv_heads, group_size, head_dim)
        for group in metadata.decode_groups:
            num_seqs = group.mask.shape[0]
            keys = _gather(key_cache, group.block_ids, metadata.key_scratch)  # [d * L, KvH, Dh]
            values = _gather(value_cache, group.block_ids, metadata.value_scratch)
            keys = keys.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)  # [d, KvH, L, Dh]
            values = values.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
            if group.rows is None:
                grouped_out.copy_(
                    F.scaled_dot_product_attention(
                        grouped_query, keys, values, attn_mask=group.mask, scale=scale
                    )
                )
            else:
                result = F.scaled_dot_product_attention(
                    grouped_query.index_select(0, group.rows), keys, values, attn_mask=group.mask, scale=scale
                )  # [d, KvH, G, Dh]
                grouped_out.index_copy_(0, group.rows, result)

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
        out: torch.Tensor,  # [N, H, Dh], rows [token_start, token_end) written here
    ) -> None:
        start, end = plan.token_start, plan.token_end
        if plan.block_ids is None:
            keys, values = key[start:end], value[start:end]  # [C, KvH, Dh]
        else:
            keys = _gather(key_cache, plan.block_ids, metadata.key_scratch)[: plan.context_len]
            values = _gather(value_cache, plan.block_ids, metadata.value_scratch)[: plan.context_len]
        result = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1).unsqueeze(0),  # [1, H, q, Dh]
            keys.transpose(0, 1).unsqueeze(0),  # [1, KvH, C, Dh]
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=plan.bias,
            is_causal=plan.bias is None,
            scale=scale,
            enable_gqa=True,
        )  # [1, H, q, Dh]
        out[start:end].copy_(result[0].transpose(0, 1))


def _decode_groups(batch: AttentionBatch, block_size: int) -> tuple[DecodeGroup, ...]:
    """Split the decode group into runs of similar length, so that gathers pad little."""
    num_decodes = batch.num_decode_tokens
    if not num_decodes:
        return ()
    seq_lens = batch.decode_seq_lens
    device = seq_lens.device
    tables = batch.decode_block_tables
    if num_decodes <= DECODE_GROUP_SIZE:
        order_chunks: list[torch.Tensor | None] = [None]
    else:
        order = torch.argsort(seq_lens)
        order_chunks = list(torch.split(order, DECODE_GROUP_SIZE))
    groups = []
    for rows in order_chunks:
        lens = seq_lens if rows is None else seq_lens.index_select(0, rows)
        max_blocks = math.ceil(int(lens.max()) / block_size)
        rows_tables = tables if rows is None else tables.index_select(0, rows)
        positions = torch.arange(max_blocks * block_size, device=device)
        mask = positions[None, :] < lens[:, None]  # [d, L]
        groups.append(
            DecodeGroup(
                rows=rows,
                block_ids=rows_tables[:, :max_blocks].reshape(-1),
                mask=mask.view(lens.shape[0], 1, 1, max_blocks * block_size),
            )
        )
    return tuple(groups)


def _prefix_causal_bias(
    num_tokens: int, num_cached: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[q, num_cached + q] additive mask: query j (at position num_cached + j) sees keys 0..num_cached + j."""
    query_positions = torch.arange(num_cached, num_cached + num_tokens, device=device)
    key_positions = torch.arange(num_cached + num_tokens, device=device)
    future = key_positions[None, :] > query_positions[:, None]
    return torch.zeros(future.shape, dtype=dtype, device=device).masked_fill_(future, float("-inf"))


def _slot_view(cache: torch.Tensor, metadata: TorchAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """`slot_view` of the batch's slots, their rows computed by the first layer and
    kept in the metadata for the others."""
    stride = cache.stride(0)
    view, rows = slot_view(cache, metadata.slot_mapping, metadata.slot_rows.get(stride))
    metadata.slot_rows[stride] = rows
    return view, rows


def slot_view(
    cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A view of `cache` with one row per token slot, and the rows of `slot_mapping`'s
    slots (`rows`, if given, are those rows already computed).

    The cache is `[num_blocks, block_size, KvH, Dh]` with contiguous slots inside a
    block but any block stride (a block-major KVCache strides by the whole block
    row). Seen as rows of KvH * Dh elements from the cache's start, slot o of block b
    is row b * (stride(0) / row) + o: the view spans the rows between blocks too,
    which the computed rows never touch.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    row = num_kv_heads * head_dim
    if cache.stride()[1:] != (row, head_dim, 1) or cache.stride(0) % row or cache.stride(0) < block_size * row:
        raise ValueError(f"cache blocks must be disjoint runs of contiguous slot rows, got strides {cache.stride()}")
    stride_rows = cache.stride(0) // row
    if rows is None:
        slots = slot_mapping
        rows = slots if stride_rows == block_size else slots // block_size * stride_rows + slots % block_size
    num_rows = (num_blocks - 1) * stride_rows + block_size if num_blocks else 0
    return cache.as_strided((num_rows, num_kv_heads, head_dim), (row, head_dim, 1)), rows


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Blocks `block_ids` of `cache`, concatenated: [len(block_ids) * block_size, KvH, Dh].

    index_select on the 2-D view copies whole blocks as rows into `scratch`.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = torch.index_select(
        cache.view(num_blocks, -1), 0, block_ids, out=scratch[: block_ids.shape[0]]
    )
    return rows.view(-1, num_kv_heads, head_dim)
