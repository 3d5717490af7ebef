"""Unified paged attention in Triton: decodes and prefill chunks in one launch.

The flattened batch holds B sequences back to back; sequence b's new tokens are
rows [query_start[b], query_start[b+1]) of the query, and its context (cached
prefix plus those tokens, already stored) is `seq_lens[b]` keys long, scattered
over the blocks listed in `block_tables[b]`.

One program handles one q-tile (BLOCK_Q consecutive new tokens of one sequence)
times the G = H / KvH query heads that share one KV head, so each K/V tile is
loaded once for all of them. Its BLOCK_M = BLOCK_Q * G_PAD rows are

    row m  ->  token  tile_start + m // G_PAD,  head  kv_head * G + m % G_PAD
               (rows with m % G_PAD >= G, or past the sequence's tokens, are masked)

The grid is (q-tiles, KvH[, splits]). Sequence b's q-tiles start at tile
`first_tile(b) = (query_start[b] + b * (BLOCK_Q - 1)) // BLOCK_Q`, which leaves
at least ceil(q_b / BLOCK_Q) tiles between consecutive sequences, so no
per-step tile table is built on the host: a program finds its sequence by a
binary search over query_start, and the few programs past their sequence's
tokens return at once. Decode-only batches get exactly one tile per sequence.

    program_id(0):  0   1   2 | 3 | 4   5 | 6 ...        (BLOCK_Q = 16)
    sequence:       b=0 (40 tokens) | b=1 (1) | b=2 (20) | ...
    q-tile:         0   1   2 | 0 | 0   1 | ...

A program scans keys in tiles of TILE_N (independent of the block size: key n
lives in block block_tables[b, n // block_size] at offset n % block_size), only
up to the causal bound of its last token, with an online softmax in float32
(exp2, the scale folded into log2 units).

Split-KV (flash-decoding), for decode-only batches with few (sequence, KV head)
pairs: program_id(2) picks a contiguous range of the context; each split writes
its unnormalised accumulator, running max and sum-exp to float32 scratch, and
`_combine_splits_kernel` merges them. A split past a short context is empty and
writes max = -inf, which weighs zero in the merge.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.triton_lang import cdiv, max_along, sum_along

_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first q-tile is at or before tile_id."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = (tl.load(query_start_ptr + mid) + mid * (BLOCK_Q - 1)) // BLOCK_Q
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The batch size and the block tables' width change every step: specializing on their
# values (== 1, divisible by 16) would compile variants mid-run for no gain.
@triton.jit(do_not_specialize=["num_seqs", "stride_table"])
def _paged_attention_kernel(
    query_ptr,  # [N, H, Dh], rows and heads strided
    key_cache_ptr,  # [num_blocks, block_size, KvH, Dh], blocks strided
    value_cache_ptr,
    out_ptr,  # [N, H, Dh]
    query_start_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    block_tables_ptr,  # [B, max_blocks]
    table_stride_ptr,  # [1]: block_tables' row stride, when TABLE_STRIDE_IN_MEMORY
    partial_out_ptr,  # [N, H, NUM_SPLITS, Dh] float32 (split-KV only)
    partial_max_ptr,  # [N, H, NUM_SPLITS] float32, log2 units
    partial_sum_ptr,  # [N, H, NUM_SPLITS] float32
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_heads,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    NUM_QUERIES_PER_KV: tl.constexpr,  # G
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q * G_PAD, >= 16 for tl.dot
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TABLE_STRIDE_IN_MEMORY: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_ptr, tile_id, num_seqs, BLOCK_Q)
    query_begin = tl.load(query_start_ptr + seq)  # int64: row of the sequence's first new token
    query_len = (tl.load(query_start_ptr + seq + 1) - query_begin).to(tl.int32)
    first_tile = (query_begin + seq * (BLOCK_Q - 1)) // BLOCK_Q
    tile_start = ((tile_id - first_tile) * BLOCK_Q).to(tl.int32)
    if tile_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    token = tile_start + rows // G_PAD  # [BLOCK_M] index among the sequence's new tokens
    head_in_group = rows % G_PAD
    head = kv_head * NUM_QUERIES_PER_KV + head_in_group
    row_valid = (token < query_len) & (head_in_group < NUM_QUERIES_PER_KV)
    position = prefix_len + token  # [BLOCK_M] the token's position in its sequence
    query_row = query_begin + token  # [BLOCK_M] int64
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q = tl.load(
        query_ptr + query_row[:, None] * stride_query_token + head[:, None] * stride_query_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]

    # Keys visible to the tile's last token; a split takes its share of them.
    kv_end = prefix_len + tl.minimum(tile_start + BLOCK_Q, query_len)
    if NUM_SPLITS > 1:
        split_len = cdiv(cdiv(kv_end, NUM_SPLITS), TILE_N) * TILE_N
        kv_begin = split * split_len
        kv_stop = tl.minimum(kv_begin + split_len, kv_end)
    else:
        kv_begin = 0
        kv_stop = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)  # running sum of exp2
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    if TABLE_STRIDE_IN_MEMORY:  # a launch replayed (CUDA graph) over tables of any width
        stride_table = tl.load(table_stride_ptr)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    offs_n = tl.arange(0, TILE_N)
    for tile_begin in range(kv_begin, kv_stop, TILE_N):
        keys = tile_begin + offs_n  # [TILE_N] key positions
        key_valid = keys < kv_stop
        block_id = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0)
        # 64-bit: a whole cache exceeds 2^31 elements on large models.
        slot = (block_id.to(tl.int64) * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
                + kv_head * stride_cache_head)  # [TILE_N]
        k = tl.load(key_cache_ptr + slot[None, :] + dims[:, None],
                    mask=key_valid[None, :] & dim_valid[:, None], other=0.0)  # [HEAD_DIM_PAD, TILE_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        visible = key_valid[None, :] & (keys[None, :] <= position[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, max_along(s, 1))
        # A row with nothing visible yet keeps max -inf: subtract 0 instead of -inf (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + sum_along(p, 1)
        v = tl.load(value_cache_ptr + slot[:, None] + dims[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # [TILE_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS > 1:
        partial_row = (query_row * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M] int64
        tl.store(partial_max_ptr + partial_row, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + partial_row, l_i, mask=row_valid)
        tl.store(partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=store_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + query_row[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _combine_splits_kernel(
    partial_out_ptr,  # [N, H, NUM_SPLITS, Dh] float32, unnormalised
    partial_max_ptr,  # [N, H, NUM_SPLITS] float32, log2 units; -inf for an empty split
    partial_sum_ptr,  # [N, H, NUM_SPLITS] float32
    out_ptr,  # [N, H, Dh]
    num_heads,
    stride_out_token,
    stride_out_head,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first = (token * num_heads + head) * NUM_SPLITS
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    m = tl.load(partial_max_ptr + first + splits, mask=split_valid, other=float("-inf"))
    l = tl.load(partial_sum_ptr + first + splits, mask=split_valid, other=0.0)
    # Split 0 always holds key 0, so the max is finite and empty splits weigh exp2(-inf) = 0.
    weight = tl.exp2(m - max_along(m, 0))  # [SPLITS_PAD]
    acc = tl.load(partial_out_ptr + (first + splits)[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_valid[:, None] & dim_valid[None, :], other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    out = sum_along(acc * weight[:, None], 0) / sum_along(l * weight, 0)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_valid)


class _LaunchParams(NamedTuple):
    block_q: int  # new tokens per program
    tile_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int


def _launch_params(
    num_queries_per_kv: int, head_dim: int, max_query_len: int, dtype: torch.dtype, is_gpu: bool,
    tile_n: int | None,
) -> _LaunchParams:
    """Tile sizes. BLOCK_M = BLOCK_Q * G_PAD rows, at least 16 (tl.dot's minimum on GPU).

    On an H100 (checked by compiling for sm_90 with ptxas under Triton 3.6 and 3.9, not
    run: at most 216 registers, no spills beyond 4-8 bytes in a few decode variants,
    at most 80 KB of shared memory with two stages), 16-bit types take 64-key tiles and, for
    prefill chunks, up to 64 rows; float32 (exact "ieee" dots, no tensor cores) spills
    past 16x16 tiles, so it keeps them small. The interpreter runs programs one at a
    time in numpy: 16-key tiles and up to 32 rows keep tests quick and still cross
    block and tile boundaries.
    """
    group_pad = triton.next_power_of_2(num_queries_per_kv)
    if is_gpu and dtype == torch.float32:
        max_rows, default_tile_n = 16, 16
    elif is_gpu:
        max_rows, default_tile_n = 64, 64 if head_dim <= 128 else 32
    else:
        max_rows, default_tile_n = 32, 16
    # Decodes need one token per tile; chunks fill up to max_rows rows.
    rows = min(max_rows, triton.next_power_of_2(max_query_len) * group_pad)
    block_q = max(16, group_pad, rows) // group_pad
    return _LaunchParams(block_q=block_q, tile_n=tile_n or default_tile_n, num_warps=4, num_stages=2)


# Shorter contexts are never split: one program per (sequence, KV head) reads them quickly.
# A split covers at least MIN_KEYS_PER_SPLIT keys. A single program walking its keys tile by
# tile is bound by latency, not bandwidth, long before 1024 keys (the earlier threshold);
# docs/gpu.md ("The first GPU runs") has the figures measured on an H200.
MIN_SPLIT_SEQ_LEN = 128
MIN_KEYS_PER_SPLIT = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits of the context for a decode-only batch: 1 unless the (sequence, KV head)
    programs leave SMs idle and contexts are long enough; then about two programs per SM,
    each split covering at least MIN_KEYS_PER_SPLIT keys, at most 32 splits."""
    num_programs = num_seqs * num_kv_heads
    if num_programs >= num_sms or max_seq_len < MIN_SPLIT_SEQ_LEN:
        return 1
    wanted = math.ceil(2 * num_sms / num_programs)
    return max(1, min(wanted, max_seq_len // MIN_KEYS_PER_SPLIT, 32))


def choose_static_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """`choose_num_splits` for a static decode batch (a CUDA graph's, engine/runner/decode_graphs.py):
    for its longest context rounded up to a power of 2, so that a batch size gets a new
    split count (a graph) at most once per doubling of the context. Contexts too short to
    split keep 1. Never fewer splits than `choose_num_splits` gives the context itself."""
    if max_seq_len < MIN_SPLIT_SEQ_LEN:
        return 1
    return choose_num_splits(num_seqs, num_kv_heads, triton.next_power_of_2(max_seq_len), num_sms)


def paged_attention(
    query: torch.Tensor,  # [N, H, Dh], stride(-1) == 1; may be a view of a fused qkv tensor
    key_cache: torch.Tensor,  # [num_blocks, block_size, KvH, Dh], stride(0) may span all layers
    value_cache: torch.Tensor,  # same shape and strides as key_cache
    out: torch.Tensor,  # [N, H, Dh] contiguous, written
    query_start: torch.Tensor,  # [B + 1] int64: sequence b's new tokens are rows [query_start[b], query_start[b+1])
    seq_lens: torch.Tensor,  # [B] int64: context length after this step (prefix + new tokens)
    block_tables: torch.Tensor,  # [B, max_blocks] int64; entries past a sequence's blocks are never read
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int = 1,
    *,
    tile_n: int | None = None,
    table_stride: torch.Tensor | None = None,
) -> None:
    """Causal attention of every new token over its sequence's paged context, for any
    mix of decodes and prefill chunks, in one launch (two with num_splits > 1).

    Token j of sequence b (query length q_b) sits at position seq_lens[b] - q_b + j and
    sees keys 0..that position; the caller has already stored the new tokens' K/V.
    Softmax in float32; `out` gets the query's dtype. `num_splits > 1` (split-KV, see
    `choose_num_splits`) is for decode-only batches (max_query_len == 1). `tile_n`
    overrides the key tile size (a power of 2, at least 16); None picks it for the device.
    `table_stride`, a [1] int64 device tensor, is read by the kernel as block_tables' row
    stride (block_tables is then any view of the memory the rows start at): a captured
    launch then serves tables of whatever width each step writes there.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    assert query.stride(-1) == 1 and out.is_contiguous() and out.shape == query.shape
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.stride(-1) == 1 and key_cache.stride(-2) == head_dim and key_cache.shape[-1] == head_dim
    assert query.dtype == key_cache.dtype == value_cache.dtype == out.dtype
    assert num_heads % num_kv_heads == 0 and block_tables.stride(-1) == 1
    assert query_start.shape[0] == num_seqs + 1 and query_start.is_contiguous() and seq_lens.is_contiguous()
    if num_splits > 1 and max_query_len != 1:
        raise ValueError("split-KV attention is for decode-only batches (max_query_len == 1)")
    assert tile_n is None or (tile_n >= 16 and tile_n & (tile_n - 1) == 0), tile_n
    if num_tokens == 0:
        return
    num_queries_per_kv = num_heads // num_kv_heads
    params = _launch_params(num_queries_per_kv, head_dim, max_query_len, query.dtype, query.is_cuda, tile_n)
    group_pad = triton.next_power_of_2(num_queries_per_kv)
    head_dim_pad = triton.next_power_of_2(head_dim)
    # No split past the longest context's last key tile.
    num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, params.tile_n)))
    # Each sequence's tiles start at (query_start[b] + b * (BLOCK_Q - 1)) // BLOCK_Q (module docstring).
    num_tiles = (num_tokens + num_seqs * (params.block_q - 1)) // params.block_q
    if num_splits > 1:
        partial_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                                  device=query.device)
        partial_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:  # unused by the kernel: any tensor will do
        partial_out = partial_max = partial_sum = out
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        query, key_cache, value_cache, out,
        query_start, seq_lens, block_tables,
        block_tables if table_stride is None else table_stride,
        partial_out, partial_max, partial_sum,
        scale * _LOG2E, num_seqs, num_heads,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        G_PAD=group_pad,
        BLOCK_Q=params.block_q,
        BLOCK_M=params.block_q * group_pad,
        TILE_N=params.tile_n,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        # Exact float32 dots (tf32 would cost ~1e-3 relative); 16-bit types ignore it.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        TABLE_STRIDE_IN_MEMORY=table_stride is not None,
        num_warps=params.num_warps,
        num_stages=params.num_stages,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            partial_out, partial_max, partial_sum, out,
            num_heads, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            num_warps=4,
        )
