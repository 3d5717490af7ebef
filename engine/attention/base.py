"""Attention over a paged KV cache: the batch layout record and the backend contract.

KV cache, per layer, a pair of tensors (key_cache, value_cache), each

    [num_blocks, block_size, num_kv_heads, head_dim]   (model dtype)

A flat slot is `block_id * block_size + offset_in_block`; the cache viewed as
`[num_blocks * block_size, num_kv_heads, head_dim]` is indexed by slot.

One forward pass runs N tokens flattened with no padding, decodes first:

    token index:  0 ........ D-1 | D ..... chunk 0 ..... | chunk 1 ... | ... N-1
                  one per decode |  q0 tokens, contiguous |  q1 tokens  |
                  sequence       |                       |             |
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
    """Layout of one flattened batch of N tokens; built by the model runner once per forward."""

    slot_mapping: torch.Tensor  # [N] int64, where each new token's K/V is written
    num_decode_tokens: int  # D: the first D tokens are decodes (query length 1)
    decode_block_tables: torch.Tensor  # [D, max_blocks] int64, rows padded with 0
    decode_seq_lens: torch.Tensor  # [D] int64, context length including the new token
    decode_max_seq_len: int
    prefills: tuple[PrefillChunk, ...]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def check_integrity(self, block_size: int) -> None:
        """Assert the layout invariants (tests and debug runs call this)."""
        num_decodes = self.num_decode_tokens
        assert self.decode_block_tables.shape[0] == num_decodes
        assert self.decode_seq_lens.shape == (num_decodes,)
        if num_decodes:
            assert int(self.decode_seq_lens.max()) == self.decode_max_seq_len
            assert int(self.decode_seq_lens.min()) >= 1
            max_blocks_needed = math.ceil(self.decode_max_seq_len / block_size)
            assert self.decode_block_tables.shape[1] >= max_blocks_needed
        next_token = num_decodes
        for chunk in self.prefills:
            assert chunk.token_start == next_token, "prefill chunks must be contiguous"
            assert 1 <= chunk.num_tokens <= chunk.context_len
            assert chunk.block_ids.shape == (math.ceil(chunk.context_len / block_size),)
            next_token += chunk.num_tokens
        assert next_token == self.num_tokens


@dataclass(frozen=True, slots=True)
class SequenceSpan:
    """One sequence's share of a step, as input to `build_attention_batch`."""

    block_ids: Sequence[int]  # the sequence's blocks in order, covering the new tokens
    num_cached_tokens: int  # tokens already in the cache before this step
    num_new_tokens: int


def build_attention_batch(
    decodes: Sequence[SequenceSpan], prefills: Sequence[SequenceSpan], block_size: int
) -> AttentionBatch:
    """Lay out decodes (one new token each) then prefill chunks as an AttentionBatch.

    A convenience for runners and tests; the token order of the batch is the
    order of `decodes` followed by the order of `prefills`.
    """
    slots: list[int] = []
    for span in (*decodes, *prefills):
        for position in range(span.num_cached_tokens, span.num_cached_tokens + span.num_new_tokens):
            slots.append(span.block_ids[position // block_size] * block_size + position % block_size)

    seq_lens = [span.num_cached_tokens + span.num_new_tokens for span in decodes]
    assert all(span.num_new_tokens == 1 for span in decodes), "a decode adds exactly one token"
    max_blocks = max((math.ceil(n / block_size) for n in seq_lens), default=0)
    tables = torch.zeros(len(decodes), max_blocks, dtype=torch.int64)
    for row, (span, seq_len) in enumerate(zip(decodes, seq_lens)):
        num_blocks = math.ceil(seq_len / block_size)
        tables[row, :num_blocks] = torch.as_tensor(list(span.block_ids[:num_blocks]))

    chunks = []
    token_start = len(decodes)
    for span in prefills:
        context_len = span.num_cached_tokens + span.num_new_tokens
        num_blocks = math.ceil(context_len / block_size)
        block_ids = torch.as_tensor(list(span.block_ids[:num_blocks]), dtype=torch.int64)
        chunks.append(PrefillChunk(token_start, span.num_new_tokens, context_len, block_ids))
        token_start += span.num_new_tokens

    return AttentionBatch(
        slot_mapping=torch.as_tensor(slots, dtype=torch.int64),
        num_decode_tokens=len(decodes),
        decode_block_tables=tables,
        decode_seq_lens=torch.as_tensor(seq_lens, dtype=torch.int64),
        decode_max_seq_len=max(seq_lens, default=0),
        prefills=tuple(chunks),
    )


class AttentionBackend(ABC):
    """Paged attention for one flattened batch; one instance serves all layers.

    Per forward pass the runner calls `build_metadata` once, then each layer
    calls `forward` with that metadata. Implementations keep no per-batch state
    outside the metadata object.
    """

    name: str

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
