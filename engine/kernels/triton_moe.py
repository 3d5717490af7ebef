"""Fused mixture-of-experts in Triton: routing alignment and one grouped GEMM for both
expert projections (the design of vLLM's and SGLang's `fused_moe`).

Each token m picks k experts; its output is

    out[m] = sum_j topk_weights[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])),   e = topk_ids[m, j]

A (token, slot) pair is called a slot, numbered s = m * k + j. `moe_align_block_size`
sorts the M * k slots by expert and pads each expert's group to a multiple of
BLOCK_M with the sentinel M * k, so that a tile of BLOCK_M sorted rows belongs to one
expert:

    sorted_token_ids: | e0 e0 e0 -- | e1 e1 e1 e1 | e1 -- -- -- | e3 -- -- -- | -- ...
    expert_ids:       |     0       |     1       |     1       |     3       | (unused)
                      '-- block 0 --'                                '-- num_tokens_post_padded

(-- the sentinel; e2 got no slot, so no block.) The arrays are sized for the worst case,
`max_padded = M*k + min(E, M*k) * (BLOCK_M - 1)` entries, known on the host; how many
are used stays on the device, and `_fused_moe_kernel` reads it and returns early past it.
No step of the routing or the GEMMs syncs with the host, so a MoE layer captures in a
CUDA graph.

`_fused_moe_kernel` runs a program per (sorted block of BLOCK_M rows, BLOCK_N output
columns). It gathers its rows of A, multiplies them by its expert's weight tile
(weights [E, N, K], nn.Linear's layout per expert) in float32 and scatters the rows to
their slots:

    gate_up = A1 @ w13[e]^T   A1 row = slot // k (every slot of a token reads its hidden row)
    act     = silu(gate) * up (gate columns [0, I), up columns [I, 2I))
    down    = A2 @ w2[e]^T    A2 row = slot (the activations are per slot), times the
                              slot's routing weight (MUL_ROUTED_WEIGHT) before the rounding
    out     = down.view(M, k, H).sum(1)

FP8 weights (float8_e4m3fn), with activations quantized per token on the fly, as
`engine.kernels.triton_fp8` does for dense layers; each scale multiplies its fp8 values:

    per channel  w_scale [E, N],                           a_scale [rows, 1]: applied after the K loop
    block-wise   w_scale [E, ceil(N / bn), ceil(K / bk)],  a_scale [rows, ceil(K / bk)]: applied to each
                 BLOCK_K partial product (BLOCK_K divides bk) before it joins the accumulator

Tile sizes come from `moe_config`: JSON files under moe_configs/ written by
benchmarks/tune_moe.py per (E, H, I, device, dtype), else a heuristic by batch size.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.triton_lang import cdiv, grouped_tile_ids
from engine.kernels.triton_ops import silu_and_mul

FP8_DTYPE = torch.float8_e4m3fn
MOE_CONFIG_DIR = Path(__file__).parent / "moe_configs"
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


class MoeAlignment(NamedTuple):
    """The slots sorted by expert, in groups padded to BLOCK_M (see the module docstring)."""

    sorted_token_ids: torch.Tensor  # [max_padded] int32: slot ids; M * k pads
    expert_ids: torch.Tensor  # [max_padded / BLOCK_M] int32: the expert of each block
    num_tokens_post_padded: torch.Tensor  # [1] int32: entries in use, a multiple of BLOCK_M


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """Entries `moe_align_block_size` allocates: each expert that gets a slot (at most
    min(E, slots) of them) pads its group by at most BLOCK_M - 1."""
    return num_slots + min(num_experts, num_slots) * (block_m - 1)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> MoeAlignment:
    """Sort the slots of topk_ids [M, k] by expert (slot order within an expert), each
    expert's group padded to a multiple of block_m with the sentinel M * k.

    Device ops of fixed sizes only (scatter_add, cumsum, a stable sort, searchsorted):
    nothing waits for the host, so the routing captures in a CUDA graph. Expert ids
    must lie in [0, num_experts) (not checked: a check would sync)."""
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    max_padded = max_padded_slots(num_slots, num_experts, block_m)
    device = topk_ids.device
    experts = topk_ids.reshape(-1).to(torch.int64)  # [M*k], the expert of each slot
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))  # [E]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)  # [E], where each expert's padded group ends
    padded_starts = padded_ends - padded_counts
    group_starts = counts.cumsum(0) - counts  # [E], where each group starts among the sorted slots
    sorted_experts, order = torch.sort(experts, stable=True)  # [M*k]: order[i] is the i-th slot by expert
    rank = torch.arange(num_slots, device=device) - group_starts[sorted_experts]  # place within its group
    sorted_token_ids = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, padded_starts[sorted_experts] + rank, order.to(torch.int32))
    # A block's expert: the first whose padded group ends past the block's start. Blocks
    # past the used entries get E (clamped; the GEMM never reads them).
    block_starts = torch.arange(0, max_padded, block_m, device=device)  # [max_blocks]
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return MoeAlignment(sorted_token_ids, expert_ids.to(torch.int32), padded_ends[-1:].to(torch.int32))


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [num_a_rows, K]: hidden [M, K] (SLOTS_PER_ROW = k) or per-slot activations [M*k, K] (1)
    b_ptr,  # [E, N, K] expert weights
    c_ptr,  # [M*k, N], one row per slot
    a_scale_ptr,  # FP8: [num_a_rows, 1] (per channel) or [num_a_rows, cdiv(K, group_k)] (block) float32
    b_scale_ptr,  # FP8: [E, N] (per channel) or [E, cdiv(N, group_n), cdiv(K, group_k)] (block) float32
    topk_weights_ptr,  # [M*k] contiguous (MUL_ROUTED_WEIGHT only)
    sorted_token_ids_ptr,  # [num_padded] int32; num_slots: padding
    expert_ids_ptr,  # [cdiv(num_padded, BLOCK_M)] int32
    num_tokens_post_padded_ptr,  # [1] int32
    N,
    K,
    num_padded,
    num_slots,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_asm,
    stride_ask,
    stride_bse,
    stride_bsn,
    stride_bsk,
    group_n,
    group_k,
    SLOTS_PER_ROW: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    PER_CHANNEL_FP8: tl.constexpr,
    BLOCK_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # BLOCK_FP8: divides group_k
    GROUP_M: tl.constexpr,
):
    # GROUP_M row blocks walk the column tiles together: neighbouring blocks mostly share
    # an expert, so its weight tiles are read from L2 while still there.
    pid_m, pid_n = grouped_tile_ids(num_padded, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return

    entries = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_token_ids_ptr + entries).to(tl.int64)  # [BLOCK_M]
    slot_valid = slots < num_slots
    # Padding rows and columns past N read row / column 0 (in bounds); the store drops them.
    slots_in = tl.where(slot_valid, slots, 0)
    a_rows = slots_in // SLOTS_PER_ROW  # [BLOCK_M]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    cols_in = tl.where(col_valid, cols, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + expert * stride_be + cols_in[None, :] * stride_bn + ks[:, None] * stride_bk  # [BLOCK_K, BLOCK_N]
    if BLOCK_FP8:
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm  # [BLOCK_M]
        b_scale_ptrs = b_scale_ptr + expert * stride_bse + (cols_in // group_n) * stride_bsn  # [BLOCK_N]

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k_block in range(0, cdiv(K, BLOCK_K)):
        k_valid = ks < K - k_block * BLOCK_K
        a = tl.load(a_ptrs, mask=k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None], other=0.0)
        if BLOCK_FP8:
            scale_k = (k_block * BLOCK_K) // group_k
            a_scale = tl.load(a_scale_ptrs + scale_k * stride_ask)
            b_scale = tl.load(b_scale_ptrs + scale_k * stride_bsk)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        elif PER_CHANNEL_FP8:
            # Promoted to the float32 accumulator every BLOCK_K products (sm_90's fp8
            # tensor-core sums are otherwise kept at reduced precision over the whole K).
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if PER_CHANNEL_FP8:
        a_scale = tl.load(a_scale_ptr + a_rows * stride_asm)  # [BLOCK_M]
        b_scale = tl.load(b_scale_ptr + expert * stride_bse + cols_in * stride_bsn)  # [BLOCK_N]
        acc = acc * a_scale[:, None] * b_scale[None, :]
    if MUL_ROUTED_WEIGHT:
        routed_weight = tl.load(topk_weights_ptr + slots_in).to(tl.float32)  # [BLOCK_M]
        acc = acc * routed_weight[:, None]
    c_ptrs = c_ptr + slots[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=slot_valid[:, None] & col_valid[None, :])


def _grouped_gemm(
    a: torch.Tensor,  # [num_a_rows, K], fp8 when a_scale is given
    a_scale: torch.Tensor | None,  # [num_a_rows, 1] or [num_a_rows, cdiv(K, bk)]
    w: torch.Tensor,  # [E, N, K]
    w_scale: torch.Tensor | None,  # [E, N] or [E, cdiv(N, bn), cdiv(K, bk)]
    out: torch.Tensor,  # [M*k, N], written at every slot's row
    alignment: MoeAlignment,
    topk_weights: torch.Tensor | None,  # [M*k]: multiply each row by its slot's weight
    slots_per_row: int,
    block_shape: tuple[int, int] | None,
    config: dict[str, int],
) -> None:
    _, num_out, num_k = w.shape
    assert a.shape[1] == num_k and a.stride(-1) == 1 and out.shape[1] == num_out
    sorted_token_ids, expert_ids, num_tokens_post_padded = alignment
    is_fp8 = w_scale is not None
    block_k = config["BLOCK_K"]
    group_n, group_k = block_shape if block_shape is not None else (0, 0)
    if block_shape is not None:
        assert group_k % block_k == 0, f"BLOCK_K {block_k} must divide the scale block's K {group_k}"
    scale_strides = (0,) * 5  # a_scale (row, K block), w_scale (expert, N, K block)
    if is_fp8:
        w_scale_strides = w_scale.stride() if block_shape is not None else (*w_scale.stride(), 0)  # [E, N]: no K
        scale_strides = (a_scale.stride(0), a_scale.stride(1), *w_scale_strides)
    grid = (expert_ids.numel() * triton.cdiv(num_out, config["BLOCK_N"]),)
    _fused_moe_kernel[grid](
        a, w, out,
        a_scale if is_fp8 else a, w_scale if is_fp8 else w,
        topk_weights if topk_weights is not None else a,
        sorted_token_ids, expert_ids, num_tokens_post_padded,
        num_out, num_k, sorted_token_ids.numel(), out.shape[0],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        *scale_strides,
        group_n, group_k,
        SLOTS_PER_ROW=slots_per_row,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        PER_CHANNEL_FP8=is_fp8 and block_shape is None,
        BLOCK_FP8=is_fp8 and block_shape is not None,
        # Exact float32 dots (tf32 would cost ~1e-3 relative); 16-bit types ignore it.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **config,
    )


def _quantize(x: torch.Tensor, block_shape: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    from engine.kernels.triton_fp8 import per_token_group_quant_fp8, per_token_quant_fp8

    if block_shape is None:
        return per_token_quant_fp8(x)
    return per_token_group_quant_fp8(x, block_shape[1])


def fused_moe(
    hidden: torch.Tensor,  # [M, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [M, k], float32 or hidden's dtype
    topk_ids: torch.Tensor,  # [M, k] int32 or int64
    *,
    w13_scale: torch.Tensor | None = None,  # FP8: [E, 2I] or [E, cdiv(2I, bn), cdiv(H, bk)] float32
    w2_scale: torch.Tensor | None = None,  # FP8: [E, H] or [E, cdiv(H, bn), cdiv(I, bk)] float32
    block_shape: tuple[int, int] | None = None,  # (bn, bk) of block-wise FP8 scales, e.g. (128, 128)
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The experts' SwiGLU MLPs of every token, weighted by its routing weights and summed
    over its k slots -> [M, H] in hidden's dtype. FP8 weights (float8_e4m3fn, with both
    scales) quantize the activations of each projection per token (per token and per bk
    columns with block_shape). Without `config`, tiles come from `moe_config`."""
    num_tokens, hidden_size = hidden.shape
    num_experts, double_inter, w13_k = w13.shape
    inter = double_inter // 2
    top_k = topk_ids.shape[1]
    assert w13_k == hidden_size and double_inter == 2 * inter and w2.shape == (num_experts, hidden_size, inter)
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k) and hidden.stride(-1) == 1
    is_fp8 = w13.dtype == FP8_DTYPE
    assert w2.dtype == w13.dtype and (w13_scale is not None) == (w2_scale is not None) == is_fp8
    assert block_shape is None or is_fp8, "block_shape is for FP8 weights"
    assert not is_fp8 or w13_scale.dtype == w2_scale.dtype == torch.float32
    if is_fp8 and block_shape is None:  # per channel, [E, N] (checkpoints also ship [E, N, 1])
        w13_scale, w2_scale = w13_scale.reshape(num_experts, double_inter), w2_scale.reshape(num_experts, hidden_size)
    elif is_fp8:
        bn, bk = block_shape
        assert w13_scale.shape == (num_experts, triton.cdiv(double_inter, bn), triton.cdiv(hidden_size, bk))
        assert w2_scale.shape == (num_experts, triton.cdiv(hidden_size, bn), triton.cdiv(inter, bk))
    if num_tokens == 0:
        return hidden.new_empty(num_tokens, hidden_size)
    if config is None:
        config = moe_config(num_tokens, num_experts, hidden_size, inter, moe_dtype_name(w13.dtype, block_shape),
                            _device_name(hidden.device))
    if block_shape is not None:  # a BLOCK_K tile must stay within one scale block
        config = {**config, "BLOCK_K": min(config["BLOCK_K"], block_shape[1])}
    alignment = moe_align_block_size(topk_ids, config["BLOCK_M"], num_experts)
    num_slots = num_tokens * top_k

    a1, a1_scale = _quantize(hidden, block_shape) if is_fp8 else (hidden, None)
    gate_up = torch.empty(num_slots, double_inter, dtype=hidden.dtype, device=hidden.device)  # [M*k, 2I]
    _grouped_gemm(a1, a1_scale, w13, w13_scale, gate_up, alignment, None, top_k, block_shape, config)
    act = silu_and_mul(gate_up)  # [M*k, I]
    a2, a2_scale = _quantize(act, block_shape) if is_fp8 else (act, None)
    down = torch.empty(num_slots, hidden_size, dtype=hidden.dtype, device=hidden.device)  # [M*k, H]
    _grouped_gemm(a2, a2_scale, w2, w2_scale, down, alignment, topk_weights.contiguous().view(-1), 1,
                  block_shape, config)
    if top_k == 1:
        return down
    return down.view(num_tokens, top_k, hidden_size).sum(1)


# ----------------------------------------------------------------------------- tile configs


def moe_dtype_name(weight_dtype: torch.dtype, block_shape: tuple[int, int] | None = None) -> str:
    """The `dtype` of a config file: the weights' dtype, or which FP8 form."""
    if weight_dtype == FP8_DTYPE:
        return "fp8_w8a8" if block_shape is None else "fp8_w8a8_block_{}x{}".format(*block_shape)
    return str(weight_dtype).removeprefix("torch.")


def moe_config_file_name(num_experts: int, hidden: int, intermediate: int, dtype: str, device_name: str) -> str:
    """E=128,H=2048,I=768,device=NVIDIA_H200,dtype=bfloat16.json; I is per shard under tensor parallelism."""
    device = device_name.replace(" ", "_").replace("/", "_")
    return f"E={num_experts},H={hidden},I={intermediate},device={device},dtype={dtype}.json"


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@functools.cache
def _load_config_file(path: Path) -> dict[int, dict[str, int]] | None:
    """Batch-size bucket -> config, as benchmarks/tune_moe.py writes it; None without a file."""
    if not path.is_file():
        return None
    buckets = {int(size): config for size, config in json.loads(path.read_text()).items()}
    for size, config in buckets.items():
        if set(config) != set(CONFIG_KEYS):
            raise ValueError(f"{path}: the config of batch {size} must have exactly the keys {CONFIG_KEYS}")
    return buckets


def default_moe_config(num_tokens: int, dtype: str) -> dict[str, int]:
    """Tiles when no tuned file exists (vLLM's defaults by batch size): a decode batch
    spreads its few rows over many experts, so row blocks stay at tl.dot's least (16)
    and the experts' weight reads dominate; a large batch fills 128-row blocks and is
    bound by the tensor cores."""
    if num_tokens <= 32:
        block_m, block_n, group_m = 16, 64, 1
    elif num_tokens <= 96:
        block_m, block_n, group_m = 32, 64, 16
    elif num_tokens <= 512:
        block_m, block_n, group_m = 64, 128, 16
    else:
        block_m, block_n, group_m = 128, 128, 32
    block_k = 128 if dtype.startswith("fp8") else 64  # 128 bytes of K a row either way
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3)


def moe_config(num_tokens: int, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype | str,
               device_name: str, *, config_dir: Path = MOE_CONFIG_DIR) -> dict[str, int]:
    """The tiles for a batch of num_tokens: the nearest batch-size bucket of the tuned file
    for (E, H, I, device, dtype) under config_dir, else `default_moe_config`. dtype: a
    torch dtype or a `moe_dtype_name` (FP8 forms are named by it)."""
    dtype_name = dtype if isinstance(dtype, str) else moe_dtype_name(dtype)
    buckets = _load_config_file(config_dir / moe_config_file_name(num_experts, hidden, intermediate, dtype_name,
                                                                  device_name))
    if not buckets:
        return default_moe_config(num_tokens, dtype_name)
    return dict(buckets[min(buckets, key=lambda size: (abs(size - num_tokens), size))])
