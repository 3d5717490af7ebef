"""Attention over a paged KV cache: the batch layout record and the backend contract.

KV cache, per layer, a pair of tensors (key_cache, value_cache), each

    [num_blocks, block_size, num_kv_heads, head_dim]   (model dtype)

A flat slot is `block_id * block_size + offset_in_block`; the cache viewed as
`[num_blocks * block_size, num_kv_heads, head_dim]` is indexed by slot.

One forward pass runs N tokens of B sequences flattened with no padding,
decodes first:

    token index:  0 ........ D-1 | D ..... chunk 0 ..... | chunk 1 ... | ... N-1
                  one per decode |  q0 tokens, contiguous |  q1 tokens  |
                  sequence       |                       |             |
    sequence:     0 ........ D-1 | D                     | D + 1       | ... B-1

Every sequence is described alike (`query_start`, `seq_lens`, `block_tables`),
so a kernel can run decodes and chunks in one launch; `prefills` describes the
chunks again, for backends that run them one by one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One sequence's chunk of q >= 1 new tokens, contiguous in the flattened batch.

    Chunk token j sits at position `context_len - num_tokens + j` and attends to
    the keys at positions 0..that position (its prefix already in the cache plus
    the chunk's own earlier tokens).
    """

    token_start: int  # index of the chunk's first token in the flattened batch
    num_tokens: int  # query length q
    context_len: int  # tokens of this sequence in the cache after this step
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64, in order


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """Layout of one flattened batch of N tokens of B sequences; built by the model
    runner once per forward. Tensors are on the model's device; the ints are known
    on the host, so no backend needs a device sync to plan its launches."""

    slot_mapping: torch.Tensor  # [N] int64, where each new token's K/V is written
    query_start: torch.Tensor  # [B + 1] int64: sequence b's tokens are [query_start[b], query_start[b + 1])
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int64, rows padded with 0
    num_decode_tokens: int  # D: the first D sequences (and tokens) are decodes, one token each
    max_query_len: int
    max_seq_len: int
    decode_max_seq_len: int
    prefills: tuple[PrefillChunk, ...]  # sequences D..B-1 again, one record each
    # A static decode batch (engine/runner/decode_graphs.py) keeps its launches the same every
    # step: `max_seq_len` is then a bound (the longest context its graph serves, which sets
    # its split count), and block_tables' row stride,
    # the width written that step, is this [1] int64 tensor's value rather than its shape's.
    table_stride: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_block_tables(self) -> torch.Tensor:  # [D, max_blocks]
        return self.block_tables[: self.num_decode_tokens]

    @property
    def decode_seq_lens(self) -> torch.Tensor:  # [D]
        return self.seq_lens[: self.num_decode_tokens]

    def check_integrity(self, block_size: int) -> None:
        """Assert the layout invariants (tests and debug runs call this)."""
        num_decodes = self.num_decode_tokens
        num_seqs = num_decodes + len(self.prefills)
        assert self.seq_lens.shape == (num_seqs,) and self.block_tables.shape[0] == num_seqs
        query_start = self.query_start.tolist()
        assert len(query_start) == num_seqs + 1 and query_start[0] == 0
        assert query_start[-1] == self.num_tokens
        query_lens = [end - start for start, end in zip(query_start, query_start[1:])]
        assert query_lens[:num_decodes] == [1] * num_decodes
        assert max(query_lens, default=0) == self.max_query_len
        seq_lens = self.seq_lens.tolist()
        assert max(seq_lens, default=0) == self.max_seq_len
        assert max(seq_lens[:num_decodes], default=0) == self.decode_max_seq_len
        assert all(n >= q for n, q in zip(seq_lens, query_lens))
        assert self.block_tables.shape[1] >= math.ceil(self.max_seq_len / block_size)
        for index, chunk in enumerate(self.prefills):
            assert chunk.token_start == query_start[num_decodes + index], "prefill chunks must be contiguous"
            assert chunk.num_tokens == query_lens[num_decodes + index]
            assert chunk.context_len == seq_lens[num_decodes + index]
            assert chunk.block_ids.shape == (math.ceil(chunk.context_len / block_size),)


@dataclass(frozen=True, slots=True)
class SequenceSpan:
    """One sequence's share of a step, as input to `build_attention_batch`."""

    block_ids: Sequence[int]  # the sequence's blocks in order, covering the new tokens
    num_cached_tokens: int  # tokens already in the cache before this step
    num_new_tokens: int


def build_attention_batch(
    decodes: Sequence[SequenceSpan],
    prefills: Sequence[SequenceSpan],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionBatch:
    """Lay out decodes (one new token each) then prefill chunks as an AttentionBatch.

    A convenience for runners and tests; the token order of the batch is the
    order of `decodes` followed by the order of `prefills`.
    """
    assert all(span.num_new_tokens == 1 for span in decodes), "a decode adds exactly one token"
    spans = (*decodes, *prefills)
    slots: list[int] = []
    for span in spans:
        for position in range(span.num_cached_tokens, span.num_cached_tokens + span.num_new_tokens):
            slots.append(span.block_ids[position // block_size] * block_size + position % block_size)

    seq_lens = [span.num_cached_tokens + span.num_new_tokens for span in spans]
    query_lens = [span.num_new_tokens for span in spans]
    max_blocks = max((math.ceil(n / block_size) for n in seq_lens), default=0)
    tables = torch.zeros(len(spans), max_blocks, dtype=torch.int64)
    for row, (span, seq_len) in enumerate(zip(spans, seq_lens)):
        num_blocks = math.ceil(seq_len / block_size)
        tables[row, :num_blocks] = torch.as_tensor(list(span.block_ids[:num_blocks]))
    query_start = [0]
    for num_new in query_lens:
        query_start.append(query_start[-1] + num_new)

    tables = tables.to(device)
    chunks = []
    for row in range(len(decodes), len(spans)):
        num_blocks = math.ceil(seq_lens[row] / block_size)
        chunks.append(PrefillChunk(query_start[row], query_lens[row], seq_lens[row], tables[row, :num_blocks]))

    return AttentionBatch(
        slot_mapping=torch.as_tensor(slots, dtype=torch.int64, device=device),
        query_start=torch.as_tensor(query_start, dtype=torch.int64, device=device),
        seq_lens=torch.as_tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=tables,
        num_decode_tokens=len(decodes),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        decode_max_seq_len=max(seq_lens[: len(decodes)], default=0),
        prefills=tuple(chunks),
    )


class AttentionBackend(ABC):
    """Paged attention for one flattened batch; one instance serves all layers.

    Per forward pass the runner calls `build_metadata` once, then each layer
    calls `forward` with that metadata. Implementations keep no per-batch state
    outside the metadata object.
    """

    name: str
    # Whether the backend runs static decode batches (engine/runner/decode_graphs.py), whose launches
    # must not change with the step's values: padding rows (slot -1: stored nowhere, one key
    # of context) and `AttentionBatch.table_stride`. Only such a backend's steps are
    # captured as CUDA graphs.
    supports_static_batches: bool = False
    # Whether the backend applies RoPE itself, fused with the KV-cache store: the
    # model then calls `forward_rotary` with the un-rotated qkv instead of `forward`.
    fuses_rope: bool = False

    @abstractmethod
    def build_metadata(
        self,
        batch: AttentionBatch,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> object:
        """Precompute what every layer shares (masks, index tensors) for `batch`."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [N, H, Dh]
        key: torch.Tensor,  # [N, KvH, Dh]
        value: torch.Tensor,  # [N, KvH, Dh]
        key_cache: torch.Tensor,  # [num_blocks, block_size, KvH, Dh]
        value_cache: torch.Tensor,  # [num_blocks, block_size, KvH, Dh]
        metadata: object,
        scale: float,
    ) -> torch.Tensor:  # [N, H, Dh]
        """Write key/value into the caches at the batch's slots, then attend.

        Every query token attends causally to its own sequence's keys (cached
        prefix plus this step's earlier tokens and itself). `query`, `key` and
        `value` may be strided views (e.g. of a fused qkv projection); the
        caches must be contiguous. The result is contiguous, in query's dtype.
        """

    def forward_rotary(
        self,
        qkv: torch.Tensor,  # [N, H + 2 * KvH, Dh]: q, k not yet rotated, then v
        cos: torch.Tensor,  # [N, Dh]
        sin: torch.Tensor,  # [N, Dh]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: object,
        num_heads: int,
        scale: float,
    ) -> torch.Tensor:  # [N, H, Dh]
        """`forward` for backends with `fuses_rope`: rotate q and k (rotate-half RoPE,
        qkv may be changed in place), store k and v, then attend."""
        raise NotImplementedError(f"the {self.name} backend does not fuse RoPE")
