"""FP8 (float8_e4m3fn) kernels in Triton for linear layers: dynamic activation
quantization and the two scaled GEMMs that consume it.

Quantization rounds x / scale to e4m3 (round to nearest even, after clamping to
±448 so that nothing overflows to NaN), with scale = max(amax, eps) / 448 over

    per token:        one row of x                    -> scale [M, 1]
    per token group:  `group_size` columns of one row -> scale [M, ceil(K / group_size)]

so that x ≈ x_fp8 * scale. One program per row (per row-group); the scale never
leaves the device, so nothing syncs with the host.

The GEMMs compute out = (a_fp8 * a_scale) @ (w_fp8 * w_scale)^T, the scale
multiplying the fp8 value as Qwen's and DeepSeek's `weight_scale_inv` does:

    block_fp8_matmul    w_scale [ceil(N / bn), ceil(K / bk)], a_scale [M, ceil(K / bk)]
    channel_fp8_matmul  w_scale [N],                          a_scale [M, 1]

The block GEMM walks K one scale block (BLOCK_K == bk) at a time and dequantizes
each partial product before adding it to the float32 accumulator:

    acc[m, n] += dot(a[m, kb], w[n, kb]) * a_scale[m, kb] * w_scale[n // bn, kb]

(DeepSeek's `w8a8_block_fp8_matmul`). Each tl.dot starts from zero, so Hopper's
reduced-precision fp8 accumulation inside the tensor core spans one K block only;
the channel GEMM asks for the same (`max_num_imprecise_acc=BLOCK_K`) and applies
both scales once, after the loop. Every edge of M, N and K is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_lang import cdiv, grouped_tile_ids, max_along

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# Floor of the amax: an all-zero row gets a tiny scale, not 0 (x / 0 would be NaN).
QUANT_EPS = 1e-10


@triton.jit
def _round_to_e4m3(y):
    """float32 y in [-448, 448] -> the nearest e4m3fn value (ties to even), still float32,
    so that the cast that follows is exact. The GPU's cvt.rn rounds the same; Triton's
    interpreter does not (it drops the carry of a rounded-up mantissa into the exponent,
    and rounds ties up), and this keeps the one rounding the same in both."""
    bits = y.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    exponent = ((bits >> 23) & 0xFF) - 127
    significand = (bits & 0x7FFFFF) | 0x800000  # 24 bits, the leading one explicit
    # Normals (exponent >= -6) keep 3 bits below the leading one; subnormals keep their
    # ulp at 2^-9, so fewer. Past 25 dropped bits everything rounds to 0 (fp32 zero too).
    shift = tl.minimum(20 + tl.maximum(-6 - exponent, 0), 25)
    kept = significand >> shift
    dropped = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    kept += ((dropped > half) | ((dropped == half) & ((kept & 1) == 1))).to(tl.int32)
    ulp = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^-9 .. 2^5
    magnitude = kept.to(tl.float32) * ulp  # exact: kept <= 16
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quant_fp8_kernel(
    x_ptr,  # [M, K], rows strided
    out_ptr,  # [M, K] float8_e4m3fn, contiguous
    scale_ptr,  # [M, num_groups] float32, contiguous
    stride_x,
    num_cols,
    group_size,
    num_groups,
    eps,
    FP8_MAX_VALUE: tl.constexpr,
    BLOCK: tl.constexpr,  # columns a chunk: group_size, or a wide row in chunks
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    group_start = group * group_size
    group_end = tl.minimum(group_start + group_size, num_cols)
    x_row = x_ptr + row * stride_x
    chunk = tl.arange(0, BLOCK)
    # Pass 1: the group's amax. A group of BLOCK columns or fewer is one chunk (the usual
    # 128); a whole wide row is walked in chunks rather than held in registers at once.
    amax = tl.full((BLOCK,), 0.0, tl.float32)
    for start in range(group_start, group_end, BLOCK):
        cols = start + chunk
        x = tl.load(x_row + cols, mask=cols < group_end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # Correctly rounded divisions (the plain `/` of fp32 is an approximate one on NVIDIA
    # GPUs), so that scale and values match torch's `amax / 448` and `x / scale` exactly.
    scale = tl.math.div_rn(tl.maximum(max_along(amax, 0), eps), FP8_MAX_VALUE)
    scales = tl.full((BLOCK,), 1.0, tl.float32) * scale  # [BLOCK], for the elementwise division
    tl.store(scale_ptr + row * num_groups + group, scale)
    # Pass 2: quantize (the second read of a chunk comes from cache).
    for start in range(group_start, group_end, BLOCK):
        cols = start + chunk
        mask = cols < group_end
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scales), -FP8_MAX_VALUE), FP8_MAX_VALUE)
        tl.store(out_ptr + row * num_cols + cols, _round_to_e4m3(y).to(out_ptr.dtype.element_ty), mask=mask)


# Columns a program holds at once: a whole group of the usual sizes, chunks of a wide row.
_MAX_QUANT_BLOCK = 4096


def _quant_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, num_cols = x.shape
    assert x.stride(-1) == 1 and group_size > 0
    num_groups = triton.cdiv(num_cols, group_size)
    out = torch.empty(num_rows, num_cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out, scale
    block = min(triton.next_power_of_2(group_size), _MAX_QUANT_BLOCK)
    _quant_fp8_kernel[(num_rows, num_groups)](
        x, out, scale, x.stride(0), num_cols, group_size, num_groups, QUANT_EPS,
        FP8_MAX_VALUE=FP8_MAX,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )
    return out, scale


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization of x [M, K] (rows with stride(-1) == 1) ->
    (x_fp8 [M, K] float8_e4m3fn, scale [M, 1] float32), x ≈ x_fp8 * scale.
    One program a row, walking rows wider than 4096 columns in chunks."""
    return _quant_fp8(x, max(x.shape[1], 1))


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization of x [M, K] per token and per `group_size` columns (block-FP8
    activations of DeepSeek-V3 and Qwen3 FP8) -> (x_fp8 [M, K] float8_e4m3fn,
    scale [M, ceil(K / group_size)] float32); the last group may be partial."""
    return _quant_fp8(x, group_size)


@triton.jit
def _block_fp8_matmul_kernel(
    a_ptr,  # [M, K] fp8
    w_ptr,  # [N, K] fp8
    out_ptr,  # [M, N]
    a_scale_ptr,  # [M, ceil(K / BLOCK_K)] float32
    w_scale_ptr,  # [ceil(N / scale_block_n), ceil(K / BLOCK_K)] float32
    bias_ptr,  # [N] (HAS_BIAS only)
    M,
    N,
    K,
    scale_block_n,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_asm,
    stride_ask,
    stride_wsn,
    stride_wsk,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # == the scale block's K
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    col_valid = cols < N
    # Clamped row and column ids keep the loads in bounds; their results are masked at the store.
    rows_in = tl.where(row_valid, rows, 0).to(tl.int64)
    cols_in = tl.where(col_valid, cols, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_in[:, None] * stride_am + ks[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols_in[None, :] * stride_wn + ks[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    a_scale_ptrs = a_scale_ptr + rows_in * stride_asm  # [BLOCK_M]
    w_scale_ptrs = w_scale_ptr + (cols_in // scale_block_n) * stride_wsn  # [BLOCK_N]

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k_block in range(0, cdiv(K, BLOCK_K)):
        k_valid = ks < K - k_block * BLOCK_K
        a = tl.load(a_ptrs, mask=k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None], other=0.0)
        a_scale = tl.load(a_scale_ptrs + k_block * stride_ask)
        w_scale = tl.load(w_scale_ptrs + k_block * stride_wsk)
        acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _channel_fp8_matmul_kernel(
    a_ptr,  # [M, K] fp8
    w_ptr,  # [N, K] fp8
    out_ptr,  # [M, N]
    a_scale_ptr,  # [M] float32 (strided)
    w_scale_ptr,  # [N] float32 (strided)
    bias_ptr,  # [N] (HAS_BIAS only)
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_as,
    stride_ws,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    col_valid = cols < N
    rows_in = tl.where(row_valid, rows, 0).to(tl.int64)
    cols_in = tl.where(col_valid, cols, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_in[:, None] * stride_am + ks[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols_in[None, :] * stride_wn + ks[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k_block in range(0, cdiv(K, BLOCK_K)):
        k_valid = ks < K - k_block * BLOCK_K
        a = tl.load(a_ptrs, mask=k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None], other=0.0)
        # Promoted to the float32 accumulator every BLOCK_K products (on sm_90, where fp8
        # tensor-core sums are otherwise kept at reduced precision over the whole K).
        acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    a_scale = tl.load(a_scale_ptr + rows_in * stride_as)  # [BLOCK_M]
    w_scale = tl.load(w_scale_ptr + cols_in * stride_ws)  # [BLOCK_N]
    acc = acc * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def _tile_config(num_rows: int) -> dict[str, int]:
    """Tiles by M: decode (a few rows) is bound by reading the weight, so small row tiles
    and narrow column tiles spread N over many programs; prefill is bound by the tensor
    cores and takes square 128 tiles. BLOCK_M stays >= 16, tl.dot's least."""
    if num_rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    if num_rows <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def block_fp8_matmul(
    a_fp8: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, ceil(K / bk)] float32
    w_fp8: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int] = (128, 128),  # (bn, bk)
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """(a_fp8 * a_scale) @ (w_fp8 * w_scale)^T + bias -> [M, N] in out_dtype, each scale
    broadcast over its block, accumulated in float32 one K block at a time (the bias
    added in float32 before the one rounding)."""
    num_rows, num_cols_k = a_fp8.shape
    num_out, w_k = w_fp8.shape
    block_n, block_k = block
    assert w_k == num_cols_k and a_fp8.dtype == w_fp8.dtype == FP8_DTYPE
    assert block_k >= 16 and block_k & (block_k - 1) == 0, "bk must be a power of 2 of at least 16 (tl.dot's K)"
    assert a_scale.shape == (num_rows, triton.cdiv(num_cols_k, block_k)) and a_scale.dtype == torch.float32
    assert w_scale.shape == (triton.cdiv(num_out, block_n), triton.cdiv(num_cols_k, block_k))
    assert w_scale.dtype == torch.float32 and (bias is None or bias.shape == (num_out,))
    out = torch.empty(num_rows, num_out, dtype=out_dtype, device=a_fp8.device)
    if num_rows == 0 or num_out == 0:
        return out
    config = _tile_config(num_rows)
    grid = (triton.cdiv(num_rows, config["BLOCK_M"]) * triton.cdiv(num_out, config["BLOCK_N"]),)
    _block_fp8_matmul_kernel[grid](
        a_fp8, w_fp8, out, a_scale, w_scale, a_scale if bias is None else bias,
        num_rows, num_out, num_cols_k, block_n,
        a_fp8.stride(0), a_fp8.stride(1), w_fp8.stride(0), w_fp8.stride(1), out.stride(0), out.stride(1),
        a_scale.stride(0), a_scale.stride(1), w_scale.stride(0), w_scale.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_K=block_k,
        GROUP_M=8,
        **config,
    )
    return out


def channel_fp8_matmul(
    a_fp8: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, 1] float32
    w_fp8: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [N] or [N, 1] float32
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """(a_fp8 * a_scale) @ (w_fp8 * w_scale)^T + bias -> [M, N] in out_dtype: per-token
    by per-channel scales, the fallback for `torch._scaled_mm` without row-wise scaling."""
    num_rows, num_cols_k = a_fp8.shape
    num_out, w_k = w_fp8.shape
    assert w_k == num_cols_k and a_fp8.dtype == w_fp8.dtype == FP8_DTYPE
    assert a_scale.shape == (num_rows, 1) and a_scale.dtype == torch.float32
    assert w_scale.numel() == num_out and w_scale.dtype == torch.float32 and w_scale.dim() <= 2
    assert bias is None or bias.shape == (num_out,)
    out = torch.empty(num_rows, num_out, dtype=out_dtype, device=a_fp8.device)
    if num_rows == 0 or num_out == 0:
        return out
    config = _tile_config(num_rows)
    grid = (triton.cdiv(num_rows, config["BLOCK_M"]) * triton.cdiv(num_out, config["BLOCK_N"]),)
    _channel_fp8_matmul_kernel[grid](
        a_fp8, w_fp8, out, a_scale, w_scale, a_scale if bias is None else bias,
        num_rows, num_out, num_cols_k,
        a_fp8.stride(0), a_fp8.stride(1), w_fp8.stride(0), w_fp8.stride(1), out.stride(0), out.stride(1),
        a_scale.stride(0), w_scale.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_K=128,
        GROUP_M=8,
        **config,
    )
    return out
