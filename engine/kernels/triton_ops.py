"""Fused elementwise kernels in Triton around attention: RoPE with the KV-cache store,
and RMSNorm with or without the residual add.

`rope_and_store_kv` runs one program per token over the fused projection row

    qkv[t]:  | q heads [0, H) | k heads [H, H+KvH) | v heads [H+KvH, H+2KvH) |
               rotated in place  rotated in place    copied as is
                                 '-------- stored at slot_mapping[t] --------'

The q and k heads rotate as one [H + KvH, Dh / 2] tile pair (first and second
halves of each head, the rotate-half convention), in float32 and rounded once.
The cache views are `[num_blocks, block_size, KvH, Dh]` whose block stride may
span every layer (block-major cache), so slots address in 64 bits.

The RMSNorm kernels run one program per row, the whole row in one tile.

`silu_and_mul` reads the gate and up halves of the MLP's fused projection once and
writes silu(gate) * up, rounded once as torch rounds each op. `copy_rows` copies
rows of one 2-D tensor into rows of another at two lists of ids in one launch: the
ipc handoff's scattered KV blocks (one memcpy each would be host-bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_lang import sum_along


@triton.jit
def _rope_and_store_kv_kernel(
    qkv_ptr,  # [N, H + 2 * KvH, Dh], rows and heads strided
    cos_ptr,  # [N, Dh]
    sin_ptr,  # [N, Dh]
    key_cache_ptr,  # [num_blocks, block_size, KvH, Dh], blocks strided
    value_cache_ptr,
    slot_mapping_ptr,  # [N]; -1: not stored
    stride_qkv_token,
    stride_qkv_head,
    stride_cos_token,
    stride_sin_token,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    ROTATED_HEADS_PAD: tl.constexpr,  # next power of 2 of H + KvH
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HALF_DIM: tl.constexpr,
    HALF_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, HALF_DIM_PAD)
    half_valid = half < HALF_DIM
    cos_row = cos_ptr + token * stride_cos_token
    sin_row = sin_ptr + token * stride_sin_token
    cos_lo = tl.load(cos_row + half, mask=half_valid, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_row + HALF_DIM + half, mask=half_valid, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_row + half, mask=half_valid, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_row + HALF_DIM + half, mask=half_valid, other=0.0).to(tl.float32)

    # q and k heads together: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x_hi, x_lo).
    heads = tl.arange(0, ROTATED_HEADS_PAD)
    rotated = heads < NUM_HEADS + NUM_KV_HEADS
    mask = rotated[:, None] & half_valid[None, :]
    lo_ptrs = qkv_ptr + token * stride_qkv_token + heads[:, None] * stride_qkv_head + half[None, :]
    x_lo = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)  # [ROTATED_HEADS_PAD, HALF_DIM_PAD]
    x_hi = tl.load(lo_ptrs + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    out_lo = (x_lo * cos_lo[None, :] - x_hi * sin_lo[None, :]).to(qkv_ptr.dtype.element_ty)
    out_hi = (x_hi * cos_hi[None, :] + x_lo * sin_hi[None, :]).to(qkv_ptr.dtype.element_ty)
    tl.store(lo_ptrs, out_lo, mask=mask)
    tl.store(lo_ptrs + HALF_DIM, out_hi, mask=mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # KV heads to store: none for slot -1. (A scalar predicate `&`-ed into a tensor
    # mask trips the interpreter, so the slot check goes through this count.)
    num_stored_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    cache_row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
    # Rows H .. H+KvH-1 of the rotated tile are the keys (negative kv_head rows are masked q rows).
    kv_head = heads - NUM_HEADS
    key_mask = mask & ((kv_head >= 0) & (kv_head < num_stored_heads))[:, None]
    key_ptrs = key_cache_ptr + cache_row + kv_head[:, None] * stride_cache_head + half[None, :]
    tl.store(key_ptrs, out_lo.to(key_cache_ptr.dtype.element_ty), mask=key_mask)
    tl.store(key_ptrs + HALF_DIM, out_hi.to(key_cache_ptr.dtype.element_ty), mask=key_mask)

    kv_heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    value_mask = (kv_heads < num_stored_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    v = tl.load(qkv_ptr + token * stride_qkv_token + (NUM_HEADS + NUM_KV_HEADS + kv_heads[:, None]) * stride_qkv_head
                + dims[None, :], mask=value_mask, other=0.0)  # [KV_HEADS_PAD, HEAD_DIM_PAD]
    tl.store(value_cache_ptr + cache_row + kv_heads[:, None] * stride_cache_head + dims[None, :],
             v.to(value_cache_ptr.dtype.element_ty), mask=value_mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, hidden]
    residual_ptr,  # [N, hidden], updated in place (HAS_RESIDUAL only)
    weight_ptr,  # [hidden]
    out_ptr,  # [N, hidden]
    stride_x,
    stride_residual,
    stride_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Rounded to the dtype as torch's `x + residual` is, and normalised from that.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_residual + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = sum_along(x32 * x32, 0) / hidden
    normed = (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rope_and_store_kv(
    qkv: torch.Tensor,  # [N, H + 2 * KvH, Dh], stride(-1) == 1: q heads, k heads, v heads
    cos: torch.Tensor,  # [N, Dh], rotate-half convention (cat(freqs, freqs))
    sin: torch.Tensor,  # [N, Dh]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KvH, Dh], stride(0) may span all layers
    value_cache: torch.Tensor,  # same shape and strides as key_cache
    slot_mapping: torch.Tensor,  # [N] int64; -1: rotate but do not store
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Rotate the q and k heads of qkv in place (transformers' rotate-half RoPE,
    computed in float32 and rounded once), then store the rotated k and the v of
    each token at its slot (`block_id * block_size + offset`), in one launch."""
    num_tokens, num_qkv_heads, head_dim = qkv.shape
    _, block_size, cache_kv_heads, cache_head_dim = key_cache.shape
    assert num_qkv_heads == num_heads + 2 * num_kv_heads and cache_kv_heads == num_kv_heads
    assert cache_head_dim == head_dim and head_dim % 2 == 0
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert cos.shape == sin.shape == (num_tokens, head_dim)
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.stride(-1) == 1 and slot_mapping.shape == (num_tokens,)
    if num_tokens == 0:
        return
    rotated_heads_pad = triton.next_power_of_2(num_heads + num_kv_heads)
    half_dim_pad = triton.next_power_of_2(head_dim // 2)
    _rope_and_store_kv_kernel[(num_tokens,)](
        qkv, cos, sin, key_cache, value_cache, slot_mapping,
        qkv.stride(0), qkv.stride(1), cos.stride(0), sin.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        ROTATED_HEADS_PAD=rotated_heads_pad,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        HALF_DIM=head_dim // 2,
        HALF_DIM_PAD=half_dim_pad,
        BLOCK_SIZE=block_size,
        # 8 warps past 64 rotated heads of 128 dims: 4 spill registers there (sm_90 compile).
        num_warps=8 if rotated_heads_pad * half_dim_pad >= 8192 else 4,
    )


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=valid, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=valid, other=0.0)
    # torch's F.silu computes in float32 and rounds; the product rounds again.
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=valid)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up [N, 2I] (gate columns then up columns) -> [N, I]."""
    num_rows, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(-1) == 1
    inter = width // 2
    if gate_up.dtype == torch.float64:  # the kernel computes in float32
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4
    )
    return out


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, row_len, stride_src, stride_dst,
                      BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    src_row = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_row = tl.load(dst_ids_ptr + pair).to(tl.int64)
    valid = cols < row_len
    values = tl.load(src_ptr + src_row * stride_src + cols, mask=valid)
    tl.store(dst_ptr + dst_row * stride_dst + cols, values, mask=valid)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for every i, in one launch on the current stream.
    src, dst [rows, row_len] of one dtype with contiguous rows; ids int64 on the device.
    Rows in dst_ids must be distinct (each lands once); src and dst may alias only if no
    row is both read and written."""
    assert src.dim() == dst.dim() == 2 and src.shape[1] == dst.shape[1] and src.dtype == dst.dtype
    assert src.stride(1) == 1 and dst.stride(1) == 1 and src_ids.shape == dst_ids.shape
    num_pairs, row_len = src_ids.numel(), src.shape[1]
    if num_pairs == 0:
        return
    # 16 KiB a program: enough in flight per SM to stream at the memory's speed.
    block = min(triton.next_power_of_2(row_len), max(16384 // src.element_size(), 1))
    _copy_rows_kernel[(num_pairs, triton.cdiv(row_len, block))](
        src, dst, src_ids, dst_ids, row_len, src.stride(0), dst.stride(0), BLOCK=block, num_warps=8
    )


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    num_rows, hidden = x.shape
    assert x.stride(-1) == 1 and weight.shape == (hidden,) and weight.is_contiguous()
    # As torch promotes `weight * normed` (normed in x's dtype).
    out = torch.empty(num_rows, hidden, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x, x if residual is None else residual, weight, out,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual <- x + residual (in place, rounded to the dtype); returns transformers'
    LlamaRMSNorm of the new residual: normalised in float32, cast to the input dtype,
    times the weight. x, residual [N, hidden] of one dtype, rows with stride(-1) == 1."""
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    return _rms_norm(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of x [N, hidden] (rows with stride(-1) == 1)."""
    return _rms_norm(x, None, weight, eps)
