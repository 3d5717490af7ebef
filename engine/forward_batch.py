"""Flattening a step's scheduled work into model inputs.

Batch layout (no padding between sequences):

    tokens:  [ d0 d1 ... dD-1 | chunk A (qA tokens) | chunk B (qB tokens) | ... ]
             decode tokens      prefill chunks, each contiguous
             (query length 1)

Positions and KV slots come from each request's `num_computed_tokens` and its
row of the KV manager's persistent block-table array, vectorized over the
decode group so preparation stays cheap at hundreds of sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionBatch, PrefillChunk
from engine.block_pool import KVCacheManager, cdiv
from engine.request import Request
from engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Model inputs for one step plus which rows to sample."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    attn: AttentionBatch
    sample_indices: torch.Tensor  # [S] int64: rows of the hidden states to sample from
    sample_requests: list[Request]  # [S], in sample_indices order
    num_prefill_tokens: int



def prepare_forward_batch(
    out: SchedulerOutput, kv: KVCacheManager, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """Flatten the scheduled work into model inputs (decodes first, then chunks)."""
    block_size = kv.block_size
    block_tables = kv.block_tables
    get_row = kv.get_row
    requests = out.requests
    num_scheduled = out.num_scheduled_tokens

    decodes = [r for r, n in zip(requests, num_scheduled) if n == 1]
    num_decodes = len(decodes)
    chunks = [(r, n) for r, n in zip(requests, num_scheduled) if n != 1] if num_decodes != len(requests) else []

    # Decode group, vectorized.
    d_pos = np.fromiter((r.num_computed_tokens for r in decodes), np.int64, num_decodes)
    d_rows = np.fromiter((get_row(r.request_id) for r in decodes), np.int64, num_decodes)
    d_ids = np.fromiter(
        (r.all_token_ids[r.num_computed_tokens] for r in decodes), np.int64, num_decodes
    )
    max_seq_len = int(d_pos.max()) + 1 if num_decodes else 0
    d_tables = block_tables[d_rows, : cdiv(max_seq_len, block_size)]
    d_block_idx = d_pos // block_size
    d_slots = d_tables[np.arange(num_decodes), d_block_idx] * block_size + (d_pos - d_block_idx * block_size)

    # Prefill chunks, one contiguous range each.
    ids_parts = [d_ids]
    pos_parts = [d_pos]
    slot_parts = [d_slots]
    prefills: list[PrefillChunk] = []
    sample_requests = [r for r in decodes if r.num_computed_tokens + 1 == len(r.all_token_ids)]
    if len(sample_requests) == num_decodes:
        sample_idx = list(range(num_decodes))
    else:
        sample_idx = [i for i, r in enumerate(decodes) if r.num_computed_tokens + 1 == len(r.all_token_ids)]
    token_start = num_decodes
    for request, num_new in chunks:
        start = request.num_computed_tokens
        end = start + num_new
        table = block_tables[get_row(request.request_id), : cdiv(end, block_size)]
        positions = np.arange(start, end, dtype=np.int64)
        block_idx = positions // block_size
        ids_parts.append(np.asarray(request.all_token_ids[start:end], dtype=np.int64))
        pos_parts.append(positions)
        slot_parts.append(table[block_idx] * block_size + (positions - block_idx * block_size))
        prefills.append(
            PrefillChunk(
                token_start=token_start,
                num_tokens=num_new,
                context_len=end,
                block_ids=torch.from_numpy(table.copy()),
            )
        )
        token_start += num_new
        if end == len(request.all_token_ids):
            sample_requests.append(request)
            sample_idx.append(token_start - 1)

    attn = AttentionBatch(
        slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(device),
        num_decode_tokens=num_decodes,
        decode_block_tables=torch.from_numpy(d_tables).to(device),
        decode_seq_lens=torch.from_numpy(d_pos + 1).to(device),
        decode_max_seq_len=max_seq_len,
        prefills=tuple(prefills),
    )
    return ForwardBatch(
        input_ids=torch.from_numpy(np.concatenate(ids_parts)).to(device),
        positions=torch.from_numpy(np.concatenate(pos_parts)).to(device),
        attn=attn,
        sample_indices=torch.tensor(sample_idx, dtype=torch.long, device=device),
        sample_requests=sample_requests,
        num_prefill_tokens=token_start - num_decodes,
    )

