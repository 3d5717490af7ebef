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
from engine.kv.manager import KVCacheManager, cdiv
from engine.request import PENDING_TOKEN, Request
from engine.sampling.prompt_logprobs import PromptRows, prompt_rows, wants_rows
from engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Model inputs for one step plus which rows to sample."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    attn: AttentionBatch
    sample_indices: torch.Tensor  # [S] int64: rows of the hidden states to sample from
    sample_requests: list[Request]  # in sample_indices order
    num_prefill_tokens: int  # prompt (or recompute) tokens: not the decodes', not the proposals checked
    # Rows of sample_indices per sample request: 1, or 1 + k for a row checking k proposals
    # (each of its tokens is sampled); None: 1 for every request.
    sample_counts: tuple[int, ...] | None = None
    # Decode rows whose input token a step still in flight sampled (PENDING_TOKEN on the
    # host): input_ids[pending_rows[i]] is that step's sampled token pending_sources[i].
    pending_rows: torch.Tensor | None = None  # [P] int64
    pending_sources: torch.Tensor | None = None  # [P] int64
    # Prefill rows whose logits give prompt logprobs (engine.sampling.prompt_logprobs).
    prompt_rows: tuple[PromptRows, ...] = ()

    def fill_pending_inputs(self, sampled_token_ids: torch.Tensor | None) -> None:
        """Write the pending decode rows' input tokens from the previous step's sampled
        tokens [S'] (on the device: no wait for that step)."""
        if self.pending_rows is None:
            return
        assert sampled_token_ids is not None, "pending input tokens, but no step in flight"
        self.input_ids.index_copy_(0, self.pending_rows, sampled_token_ids.index_select(0, self.pending_sources))


@dataclass(frozen=True)
class PackedLayout:
    """Named int64 parts of one buffer, in order: a step's index arrays written into a
    host buffer (pinned for CUDA) and moved to the device in one non-blocking copy. Each
    part starts 16-byte aligned (an even number of int64s in): Triton specializes kernels
    on pointer alignment, and parts at varying alignment would compile variants mid-run.
    The eager path (prepare_forward_batch) and the CUDA graphs' persistent buffer
    (engine/runner/decode_graphs.py) are both laid out by one."""

    sizes: dict[str, int]

    @property
    def num_elements(self) -> int:
        return sum(size + size % 2 for size in self.sizes.values())

    def views(self, flat):
        """The parts of `flat` (a numpy array or a tensor, at least num_elements long), by name."""
        parts, offset = {}, 0
        for name, size in self.sizes.items():
            parts[name] = flat[offset:offset + size]
            offset += size + size % 2
        return parts

    def host_buffer(self, device: torch.device | str) -> torch.Tensor:
        """An empty host buffer for it, pinned when the copy goes to a CUDA device."""
        return torch.empty(self.num_elements, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")


def prepare_forward_batch(
    out: SchedulerOutput, kv: KVCacheManager, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """Flatten the scheduled work into model inputs (decodes first, then chunks).

    Every index array of the step is written into one host buffer laid out as

        [ input_ids N | positions N | slots N | query_start B+1 | seq_lens B | block_tables B*MB | samples S
          | pending rows P | pending sources P ]

    (a PackedLayout) and reaches the device in one non-blocking copy. A decode whose
    input is a PENDING_TOKEN (sampled by the step in flight) is listed in the pending
    parts; the runner fills its input id on the device (`ForwardBatch.fill_pending_inputs`).
    """
    requests, num_scheduled = out.requests, out.num_scheduled_tokens
    # A one-token step is a decode row, but for a prompt position whose logprobs are asked.
    decodes = [r for r, n in zip(requests, num_scheduled) if n == 1 and not wants_rows(r)]
    proposals = out.spec_token_ids
    checks = split_checks(requests, proposals)
    chunks = ([(r, n) for r, n in zip(requests, num_scheduled)
               if (n != 1 or wants_rows(r)) and not (proposals and r.request_id in proposals)]
              if len(decodes) + len(checks) != len(requests) else [])
    d = decode_rows(decodes, kv, checks)
    num_entries = len(d.positions)
    rows = _StepRows.gather(d, decodes, chunks, kv)
    num_seqs, num_pending = num_entries + len(chunks), len(d.pending_rows)
    layout = PackedLayout({
        "input_ids": rows.num_tokens, "positions": rows.num_tokens, "slots": rows.num_tokens,
        "query_start": num_seqs + 1, "seq_lens": num_seqs, "block_tables": rows.tables.size,
        "samples": len(rows.sample_indices), "pending_rows": num_pending, "pending_sources": num_pending,
    })
    host = layout.host_buffer(device)
    rows.pack(layout.views(host.numpy()), d)
    on_device = layout.views(host.to(device, non_blocking=True))
    return ForwardBatch(
        input_ids=on_device["input_ids"],
        positions=on_device["positions"],
        attn=rows.attention_batch(on_device, chunks, num_entries, kv.block_size),
        sample_indices=on_device["samples"],
        sample_requests=rows.sample_requests,
        num_prefill_tokens=rows.num_tokens - num_entries,
        sample_counts=tuple(rows.sample_counts) if checks else None,
        pending_rows=on_device["pending_rows"] if num_pending else None,
        pending_sources=on_device["pending_sources"] if num_pending else None,
        prompt_rows=tuple(rows.prompt_rows),
    )


@dataclass
class _StepRows:
    """A step's rows on the host: the decodes' (DecodeRows) and the prefill chunks', each
    chunk one contiguous range after the decodes."""

    tables: np.ndarray  # [B, MB]: every sequence's block-table row, cut to the step's longest
    chunk_ends: np.ndarray  # [C]: each chunk's context once computed
    max_seq_len: int
    decode_max_seq_len: int
    ids: list[np.ndarray]  # per part (the decodes, then each chunk), concatenated when packed
    positions: list[np.ndarray]
    slots: list[np.ndarray]
    query_start: list[int]  # [B + 1]
    sample_indices: list[int]  # rows of the hidden states to sample from
    sample_requests: list[Request]
    prompt_rows: list[PromptRows]  # of the chunks that ask for prompt logprobs
    num_tokens: int
    sample_counts: list[int]  # rows sampled per sample request (ForwardBatch.sample_counts)

    @classmethod
    def gather(cls, d: DecodeRows, decodes: list[Request], chunks: list[tuple[Request, int]],
               kv: KVCacheManager) -> _StepRows:
        block_size, num_decodes = kv.block_size, len(d.positions)
        decode_max_seq_len = int(d.positions.max()) + 1 if num_decodes else 0
        chunk_rows = np.fromiter((kv.get_row(r.request_id) for r, _ in chunks), np.int64, len(chunks))
        chunk_ends = np.fromiter((r.num_computed_tokens + n for r, n in chunks), np.int64, len(chunks))
        max_seq_len = max(decode_max_seq_len, int(chunk_ends.max()) if len(chunks) else 0)
        tables = kv.block_tables[np.concatenate([d.table_rows, chunk_rows]), :cdiv(max_seq_len, block_size)]
        rows = cls(tables, chunk_ends, max_seq_len, decode_max_seq_len, [d.token_ids], [d.positions], [d.slots],
                   list(range(num_decodes + 1)), d.sample_rows, d.sample_requests(decodes), [], num_decodes,
                   d.sample_counts())
        for index, (request, num_new) in enumerate(chunks):
            rows._add_chunk(request, num_new, tables[num_decodes + index], block_size)
        return rows

    def _add_chunk(self, request: Request, num_new: int, table: np.ndarray, block_size: int) -> None:
        """One prefill chunk's rows (and the prompt-logprob rows it gives, if it asks)."""
        start = request.num_computed_tokens
        end = start + num_new
        positions = np.arange(start, end, dtype=np.int64)
        block_idx = positions // block_size
        chunk_ids = np.asarray(request.all_token_ids[start:end], dtype=np.int64)
        # NOTE: a request is never readmitted before the token it last sampled is known.
        assert chunk_ids.min() >= 0, f"{request} has a pending token inside a prefill chunk"
        self.ids.append(chunk_ids)
        self.positions.append(positions)
        self.slots.append(table[block_idx] * block_size + (positions - block_idx * block_size))
        first_row = self.num_tokens
        self.num_tokens += num_new
        self.query_start.append(self.num_tokens)
        if end == len(request.all_token_ids):
            self.sample_requests.append(request)
            self.sample_indices.append(self.num_tokens - 1)
            self.sample_counts.append(1)
        if request.prompt_logprobs is not None and (found := prompt_rows(request, first_row, start, end)) is not None:
            self.prompt_rows.append(found)

    def pack(self, parts: dict[str, np.ndarray], d: DecodeRows) -> None:
        """Write the rows into the host buffer's parts (PackedLayout.views)."""
        num_decodes = len(d.positions)
        np.concatenate(self.ids, out=parts["input_ids"])
        np.concatenate(self.positions, out=parts["positions"])
        np.concatenate(self.slots, out=parts["slots"])
        parts["query_start"][:] = self.query_start
        parts["seq_lens"][:num_decodes] = d.positions + 1
        parts["seq_lens"][num_decodes:] = self.chunk_ends
        parts["block_tables"][:] = self.tables.reshape(-1)
        parts["samples"][:] = self.sample_indices
        parts["pending_rows"][:] = d.pending_rows
        parts["pending_sources"][:] = d.pending_sources

    def attention_batch(self, on_device: dict[str, torch.Tensor], chunks: list[tuple[Request, int]],
                        num_decodes: int, block_size: int) -> AttentionBatch:
        """The attention layout over the device copy's parts."""
        tables = on_device["block_tables"].view(self.tables.shape)
        prefills = tuple(
            PrefillChunk(
                token_start=self.query_start[num_decodes + index],
                num_tokens=num_new,
                context_len=int(self.chunk_ends[index]),
                block_ids=tables[num_decodes + index, : cdiv(int(self.chunk_ends[index]), block_size)],
            )
            for index, (_, num_new) in enumerate(chunks)
        )
        return AttentionBatch(
            slot_mapping=on_device["slots"],
            query_start=on_device["query_start"],
            seq_lens=on_device["seq_lens"],
            block_tables=tables,
            num_decode_tokens=num_decodes,
            max_query_len=max((n for _, n in chunks), default=1 if num_decodes else 0),
            max_seq_len=self.max_seq_len,
            decode_max_seq_len=self.decode_max_seq_len,
            prefills=prefills,
        )


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """The inputs of a step's decode entries (one query token each), gathered from the
    requests and the KV manager's block tables, vectorized over the group: the decodes,
    then one entry per token of each row checking proposals (its last token, then each
    proposal: the entry at position p attends to positions 0..p, as a decode at p would,
    over the row's block table; all of the row's KV is written before attention runs)."""

    positions: np.ndarray  # [D] int64: the new token's position
    table_rows: np.ndarray  # [D] int64: each one's row of the block tables
    token_ids: np.ndarray  # [D] int64: the input token; PENDING_TOKEN when still on the device
    slots: np.ndarray  # [D] int64: where the new token's K/V goes
    # The entries that sample: the decodes' (all but one-token chunks of longer prompts),
    # then every entry of the checking rows.
    sample_rows: list[int]
    # The rows whose input is PENDING_TOKEN, and each one's row among the sampled tokens
    # of the step in flight.
    pending_rows: np.ndarray  # [P] int64
    pending_sources: np.ndarray  # [P] int64
    checks: list[tuple[Request, list[int]]] = ()  # the rows checking proposals, and those
    num_plain_samples: int = 0  # sample_rows of the decodes (the first ones)

    def sample_requests(self, decodes: list[Request]) -> list[Request]:
        """The requests that sample, in order: the decodes' (of `decodes`, those gathered),
        then each checking row once."""
        plain = self.num_plain_samples
        sampling = list(decodes) if plain == len(decodes) else [decodes[i] for i in self.sample_rows[:plain]]
        return sampling + [request for request, _ in self.checks]

    def sample_counts(self) -> list[int]:
        """Sampled rows per sample request: 1 a decode, 1 + k a row checking k proposals."""
        return [1] * self.num_plain_samples + [len(spec) + 1 for _, spec in self.checks]


def split_checks(requests: list[Request], proposals: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
    """The step's rows that check proposals (SchedulerOutput.spec_token_ids), with them."""
    return [(r, proposals[r.request_id]) for r in requests if r.request_id in proposals] if proposals else []


def decode_rows(decodes: list[Request], kv: KVCacheManager,
                checks: list[tuple[Request, list[int]]] | None = None) -> DecodeRows:
    num_decodes = len(decodes)
    block_size = kv.block_size
    get_row = kv.get_row
    positions = np.fromiter((r.num_computed_tokens for r in decodes), np.int64, num_decodes)
    table_rows = np.fromiter((get_row(r.request_id) for r in decodes), np.int64, num_decodes)
    token_ids = np.fromiter((r.all_token_ids[r.num_computed_tokens] for r in decodes), np.int64, num_decodes)
    sample_rows = [i for i, r in enumerate(decodes) if r.num_computed_tokens + 1 == len(r.all_token_ids)]
    num_plain_samples = len(sample_rows)
    if checks:
        lengths = [len(spec) + 1 for _, spec in checks]
        starts = np.repeat([r.num_computed_tokens for r, _ in checks], lengths)
        positions = np.concatenate([positions, starts + _ranges(lengths)])
        table_rows = np.concatenate([table_rows, np.repeat([get_row(r.request_id) for r, _ in checks], lengths)])
        token_ids = np.concatenate([token_ids, np.fromiter(
            (t for r, spec in checks for t in (r.all_token_ids[r.num_computed_tokens], *spec)), np.int64)])
        sample_rows += range(num_decodes, len(positions))
    block_index = positions // block_size
    slots = kv.block_tables[table_rows, block_index] * block_size + (positions - block_index * block_size)
    pending_rows = np.flatnonzero(token_ids == PENDING_TOKEN)
    pending_sources = np.fromiter((decodes[row].pending_sample_index for row in pending_rows), np.int64,
                                  len(pending_rows))
    return DecodeRows(positions, table_rows, token_ids, slots, sample_rows, pending_rows, pending_sources,
                      checks or [], num_plain_samples)


def _ranges(lengths: list[int]) -> np.ndarray:
    """0..n-1 for each n of `lengths`, concatenated."""
    ends = np.cumsum(lengths)
    return np.arange(ends[-1]) - np.repeat(ends - lengths, lengths)
