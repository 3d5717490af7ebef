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
from engine.prompt_logprobs import PromptRows, prompt_rows, wants_rows
from engine.request import PENDING_TOKEN, Request
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
    # Decode rows whose input token a step still in flight sampled (PENDING_TOKEN on the
    # host): input_ids[pending_rows[i]] is that step's sampled token pending_sources[i].
    pending_rows: torch.Tensor | None = None  # [P] int64
    pending_sources: torch.Tensor | None = None  # [P] int64
    # Prefill rows whose logits give prompt logprobs (engine.prompt_logprobs).
    prompt_rows: tuple[PromptRows, ...] = ()

    def fill_pending_inputs(self, sampled_token_ids: torch.Tensor | None) -> None:
        """Write the pending decode rows' input tokens from the previous step's sampled
        tokens [S'] (on the device: no wait for that step)."""
        if self.pending_rows is None:
            return
        assert sampled_token_ids is not None, "pending input tokens, but no step in flight"
        self.input_ids.index_copy_(0, self.pending_rows, sampled_token_ids.index_select(0, self.pending_sources))


def prepare_forward_batch(
    out: SchedulerOutput, kv: KVCacheManager, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """Flatten the scheduled work into model inputs (decodes first, then chunks).

    Every index array of the step is written into one int64 host buffer (pinned
    for a CUDA device) and reaches the device in one non-blocking copy:

        [ input_ids N | positions N | slots N | query_start B+1 | seq_lens B | block_tables B*MB | samples S
          | pending rows P | pending sources P ]

    (each part padded to an even length). A decode whose input is a PENDING_TOKEN
    (sampled by the step in flight) is listed in the pending parts; the runner fills
    its input id on the device (`ForwardBatch.fill_pending_inputs`).
    """
    block_size = kv.block_size
    block_tables = kv.block_tables
    get_row = kv.get_row
    requests = out.requests
    num_scheduled = out.num_scheduled_tokens

    # A one-token step is a decode row, but for a prompt position whose logprobs are asked.
    decodes = [r for r, n in zip(requests, num_scheduled) if n == 1 and not wants_rows(r)]
    num_decodes = len(decodes)
    chunks = ([(r, n) for r, n in zip(requests, num_scheduled) if n != 1 or wants_rows(r)]
              if num_decodes != len(requests) else [])
    num_seqs = num_decodes + len(chunks)

    d = decode_rows(decodes, kv)
    pending_rows, pending_sources = d.pending_rows, d.pending_sources
    decode_max_seq_len = int(d.positions.max()) + 1 if num_decodes else 0
    chunk_rows = np.fromiter((get_row(r.request_id) for r, _ in chunks), np.int64, len(chunks))
    chunk_ends = np.fromiter((r.num_computed_tokens + n for r, n in chunks), np.int64, len(chunks))
    max_seq_len = max(decode_max_seq_len, int(chunk_ends.max()) if len(chunks) else 0)
    max_blocks = cdiv(max_seq_len, block_size)
    tables = block_tables[np.concatenate([d.table_rows, chunk_rows]), :max_blocks]  # [B, MB]

    # Prefill chunks, one contiguous range each.
    ids_parts = [d.token_ids]
    pos_parts = [d.positions]
    slot_parts = [d.slots]
    sample_idx = d.sample_rows
    sample_requests = list(decodes) if len(sample_idx) == num_decodes else [decodes[i] for i in sample_idx]
    query_start = list(range(num_decodes + 1))
    token_start = num_decodes
    prompt_logprob_rows: list[PromptRows] = []
    for index, (request, num_new) in enumerate(chunks):
        start = request.num_computed_tokens
        end = start + num_new
        positions = np.arange(start, end, dtype=np.int64)
        block_idx = positions // block_size
        chunk_ids = np.asarray(request.all_token_ids[start:end], dtype=np.int64)
        # NOTE: a request is never readmitted before the token it last sampled is known.
        assert chunk_ids.min() >= 0, f"{request} has a pending token inside a prefill chunk"
        ids_parts.append(chunk_ids)
        pos_parts.append(positions)
        slot_parts.append(tables[num_decodes + index, block_idx] * block_size + (positions - block_idx * block_size))
        token_start += num_new
        query_start.append(token_start)
        if request.prompt_logprobs is not None:
            rows = prompt_rows(request, token_start - num_new, start, end)
            if rows is not None:
                prompt_logprob_rows.append(rows)
        if end == len(request.all_token_ids):
            sample_requests.append(request)
            sample_idx.append(token_start - 1)
    num_tokens = token_start

    # The one host buffer, then its views on the device. Each part starts 16-byte
    # aligned (an even number of int64s in): Triton specializes kernels on pointer
    # alignment, and parts at varying alignment would compile variants mid-run.
    num_pending = len(pending_rows)
    sizes = (num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * max_blocks, len(sample_idx),
             num_pending, num_pending)
    padded = [size + size % 2 for size in sizes]
    pinned = torch.device(device).type == "cuda"
    host = torch.empty(sum(padded), dtype=torch.int64, pin_memory=pinned)
    host_parts = [part[:size] for part, size in zip(np.split(host.numpy(), np.cumsum(padded)[:-1]), sizes)]
    np.concatenate(ids_parts, out=host_parts[0])
    np.concatenate(pos_parts, out=host_parts[1])
    np.concatenate(slot_parts, out=host_parts[2])
    host_parts[3][:] = query_start
    host_parts[4][:num_decodes] = d.positions + 1
    host_parts[4][num_decodes:] = chunk_ends
    host_parts[5][:] = tables.reshape(-1)
    host_parts[6][:] = sample_idx
    host_parts[7][:] = pending_rows
    host_parts[8][:] = pending_sources
    buffer = host.to(device, non_blocking=True)
    input_ids, positions, slots, starts, seq_lens, flat_tables, samples, rows, sources = (
        part[:size] for part, size in zip(torch.split(buffer, padded), sizes)
    )
    device_tables = flat_tables.view(num_seqs, max_blocks)

    prefills = tuple(
        PrefillChunk(
            token_start=query_start[num_decodes + index],
            num_tokens=num_new,
            context_len=int(chunk_ends[index]),
            block_ids=device_tables[num_decodes + index, : cdiv(int(chunk_ends[index]), block_size)],
        )
        for index, (_, num_new) in enumerate(chunks)
    )
    attn = AttentionBatch(
        slot_mapping=slots,
        query_start=starts,
        seq_lens=seq_lens,
        block_tables=device_tables,
        num_decode_tokens=num_decodes,
        max_query_len=max((n for _, n in chunks), default=1 if num_decodes else 0),
        max_seq_len=max_seq_len,
        decode_max_seq_len=decode_max_seq_len,
        prefills=prefills,
    )
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        attn=attn,
        sample_indices=samples,
        sample_requests=sample_requests,
        num_prefill_tokens=num_tokens - num_decodes,
        pending_rows=rows if num_pending else None,
        pending_sources=sources if num_pending else None,
        prompt_rows=tuple(prompt_logprob_rows),
    )


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """The inputs of a step's decodes (one new token each), gathered from the requests
    and the KV manager's block tables, vectorized over the group."""

    positions: np.ndarray  # [D] int64: the new token's position
    table_rows: np.ndarray  # [D] int64: each one's row of the block tables
    token_ids: np.ndarray  # [D] int64: the input token; PENDING_TOKEN when still on the device
    slots: np.ndarray  # [D] int64: where the new token's K/V goes
    sample_rows: list[int]  # the rows that sample (all but one-token chunks of longer prompts)
    # The rows whose input is PENDING_TOKEN, and each one's row among the sampled tokens
    # of the step in flight.
    pending_rows: np.ndarray  # [P] int64
    pending_sources: np.ndarray  # [P] int64


def decode_rows(decodes: list[Request], kv: KVCacheManager) -> DecodeRows:
    num_decodes = len(decodes)
    block_size = kv.block_size
    get_row = kv.get_row
    positions = np.fromiter((r.num_computed_tokens for r in decodes), np.int64, num_decodes)
    table_rows = np.fromiter((get_row(r.request_id) for r in decodes), np.int64, num_decodes)
    token_ids = np.fromiter((r.all_token_ids[r.num_computed_tokens] for r in decodes), np.int64, num_decodes)
    block_index = positions // block_size
    slots = kv.block_tables[table_rows, block_index] * block_size + (positions - block_index * block_size)
    sample_rows = [i for i, r in enumerate(decodes) if r.num_computed_tokens + 1 == len(r.all_token_ids)]
    pending_rows = np.flatnonzero(token_ids == PENDING_TOKEN)
    pending_sources = np.fromiter((decodes[row].pending_sample_index for row in pending_rows), np.int64,
                                  len(pending_rows))
    return DecodeRows(positions, table_rows, token_ids, slots, sample_rows, pending_rows, pending_sources)
