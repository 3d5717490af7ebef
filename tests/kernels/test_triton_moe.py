"""The fused MoE kernels (engine/kernels/triton_moe.py) against a plain-torch reference.

Without CUDA they run on CPU tensors under Triton's interpreter, switched on before
the kernel modules are imported; the shapes are small and the tiles narrow
(TILES) so that every edge is masked: H = 48 and I = 40 are not multiples of the
32-wide N and K tiles, and batches are not multiples of BLOCK_M.

The reference is transformers' Qwen3MoeExperts.forward: a loop over the experts
that got a slot, gathering their tokens, each linear computed in float64 and rounded
to the dtype once (as a float32-accumulating GEMM rounds), silu(gate) * up in the
dtype, the weighted outputs summed in float64.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from engine.envs import use_triton_interpreter

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    use_triton_interpreter()

from engine.kernels.triton_fp8 import FP8_DTYPE, FP8_MAX, QUANT_EPS  # noqa: E402
from engine.kernels.triton_moe import (  # noqa: E402
    CONFIG_KEYS,
    default_moe_config,
    fused_moe,
    max_padded_slots,
    moe_align_block_size,
    moe_config,
    moe_config_file_name,
    moe_dtype_name,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16 tl.dot is wrong under the interpreter: bfloat16 only on a GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
TILES = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)
HIDDEN, INTER = 48, 40


@dataclass
class MoeCase:
    hidden: torch.Tensor  # [M, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    topk_weights: torch.Tensor  # [M, k] float32
    topk_ids: torch.Tensor  # [M, k] int64


def make_case(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int = 0,
              topk_ids: torch.Tensor | None = None, hidden: int = HIDDEN, inter: int = INTER) -> MoeCase:
    """Weights scaled so that every projection's outputs are O(1); routing as Qwen3's
    router does it (softmax, top-k, renormalised) unless topk_ids are given."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if topk_ids is None:
        topk_ids = logits.topk(top_k, dim=-1).indices
    topk_weights = logits.softmax(-1).gather(1, topk_ids)
    topk_weights /= topk_weights.sum(-1, keepdim=True)
    return MoeCase(
        hidden=torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE),
        w13=(torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE),
        w2=(torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype).to(DEVICE),
        topk_weights=topk_weights.to(DEVICE),
        topk_ids=topk_ids.to(DEVICE),
    )


def reference_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, dtype: torch.dtype,
                  quantize: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Qwen3MoeExperts.forward in float64 -> [M, H]. Each linear's output is rounded to
    `dtype`; `quantize` (FP8: quantize and dequantize) is applied to each linear's input."""
    hidden, w13, w2 = hidden.cpu(), w13.cpu(), w2.cpu()
    topk_weights, topk_ids = topk_weights.cpu(), topk_ids.cpu()
    quantize = quantize or (lambda x: x)

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(quantize(x).double(), weight.double()).to(dtype)

    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for expert in topk_ids.unique().tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        gate, up = linear(hidden[token_idx], w13[expert]).chunk(2, dim=-1)
        down = linear(F.silu(gate) * up, w2[expert])  # [tokens, H]
        out.index_add_(0, token_idx, down.double() * topk_weights[token_idx, slot, None].double())
    return out


def assert_matches(out: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    torch.testing.assert_close(out.double().cpu(), expected, atol=tolerance, rtol=tolerance)


# ------------------------------------------------------------------ routing alignment
def expected_alignment(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> tuple[list[int], list[int]]:
    """The used entries of sorted_token_ids and expert_ids, built one expert at a time."""
    num_slots = topk_ids.numel()
    experts = topk_ids.reshape(-1).tolist()
    sorted_ids, expert_ids = [], []
    for expert in range(num_experts):
        slots = [slot for slot in range(num_slots) if experts[slot] == expert]
        num_blocks = math.ceil(len(slots) / block_m)
        sorted_ids += slots + [num_slots] * (num_blocks * block_m - len(slots))
        expert_ids += [expert] * num_blocks
    return sorted_ids, expert_ids


ROUTINGS = {
    # (topk_ids [M, k], num_experts)
    "uneven": (torch.tensor([[3, 0], [0, 3], [1, 0], [0, 3], [5, 0]]), 6),  # experts 2 and 4 get nothing
    "one_expert": (torch.full((20, 1), 2), 4),
    "batch_1_top_8": (torch.tensor([[7, 1, 0, 9, 4, 3, 2, 8]]), 10),
    "random": (torch.randn(37, 16, generator=torch.Generator().manual_seed(1)).topk(4).indices, 16),
    "empty": (torch.zeros(0, 2, dtype=torch.int64), 4),
}


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_moe_align_block_size(routing, block_m):
    topk_ids, num_experts = ROUTINGS[routing]
    num_slots = topk_ids.numel()
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids.int().to(DEVICE), block_m, num_experts)
    max_padded = max_padded_slots(num_slots, num_experts, block_m)
    assert sorted_ids.shape == (max_padded,) and expert_ids.shape == (math.ceil(max_padded / block_m),)
    assert sorted_ids.dtype == expert_ids.dtype == num_post_padded.dtype == torch.int32
    sorted_ids, expert_ids, used = sorted_ids.cpu(), expert_ids.cpu(), int(num_post_padded)

    want_sorted, want_experts = expected_alignment(topk_ids, block_m, num_experts)
    assert used == len(want_sorted) and used % block_m == 0
    assert sorted_ids[:used].tolist() == want_sorted
    assert expert_ids[: used // block_m].tolist() == want_experts
    assert (sorted_ids[used:] == num_slots).all()  # sentinels past the used entries
    # Every (token, slot) exactly once, each in a block of its expert.
    real = sorted_ids[:used] < num_slots
    assert sorted(sorted_ids[:used][real].tolist()) == list(range(num_slots))
    block_expert = expert_ids[: used // block_m].repeat_interleave(block_m)
    assert torch.equal(topk_ids.reshape(-1)[sorted_ids[:used][real].long()], block_expert[real].long())


# ------------------------------------------------------------------ 16/32-bit weights
def skewed_ids(num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """Expert 0 gets no slot, expert 1 exactly one (token 0's first), the rest round-robin."""
    ids = torch.tensor([[2 + (token * top_k + j) % (num_experts - 2) for j in range(top_k)]
                        for token in range(num_tokens)])
    ids[0, 0] = 1
    return ids


# (tokens, experts, top-k, explicit topk_ids or None for the router's)
CASES = {
    "top2": (13, 8, 2, None),
    "empty_and_single_expert": (9, 6, 2, skewed_ids(9, 6, 2)),
    "all_to_one_expert": (21, 4, 1, torch.full((21, 1), 3)),
    "batch_1_top8": (1, 16, 8, None),
    "top8": (5, 10, 8, None),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_moe_matches_reference(case, dtype):
    num_tokens, num_experts, top_k, topk_ids = CASES[case]
    moe = make_case(num_tokens, num_experts, top_k, dtype, seed=num_tokens, topk_ids=topk_ids)
    out = fused_moe(moe.hidden, moe.w13, moe.w2, moe.topk_weights, moe.topk_ids, config=TILES)
    assert out.shape == moe.hidden.shape and out.dtype == dtype
    expected = reference_moe(moe.hidden, moe.w13, moe.w2, moe.topk_weights, moe.topk_ids, dtype)
    assert_matches(out, expected, TOLERANCE[dtype])


def test_fused_moe_default_tiles_and_routing_weights_in_dtype():
    """Tiles from moe_config (no tuned file for these shapes), int32 ids, float16
    routing weights, a 32-row BLOCK_M."""
    moe = make_case(40, 8, 2, torch.float16, seed=4)
    weights, ids = moe.topk_weights.half(), moe.topk_ids.int()
    expected = reference_moe(moe.hidden, moe.w13, moe.w2, weights, ids, torch.float16)
    assert_matches(fused_moe(moe.hidden, moe.w13, moe.w2, weights, ids), expected, TOLERANCE[torch.float16])
    tiles = {**TILES, "BLOCK_M": 32, "GROUP_M": 1}
    assert_matches(fused_moe(moe.hidden, moe.w13, moe.w2, weights, ids, config=tiles), expected,
                   TOLERANCE[torch.float16])


def test_fused_moe_empty_batch():
    moe = make_case(0, 4, 2, torch.float32)
    out = fused_moe(moe.hidden, moe.w13, moe.w2, moe.topk_weights, moe.topk_ids, config=TILES)
    assert out.shape == (0, HIDDEN)


# ------------------------------------------------------------------ FP8 weights
def quant_dequant(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic activation quantization in torch (as triton_fp8 quantizes, bit for bit):
    per row and per group_size columns, scale = amax / 448, returned dequantized."""
    groups = x.float().split(group_size, dim=-1)
    out = []
    for group in groups:
        scale = group.abs().amax(-1, keepdim=True).clamp(min=QUANT_EPS) / FP8_MAX
        out.append((group / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale)
    return torch.cat(out, dim=-1)


def quantize_weights(w: torch.Tensor, block_shape: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] float32 -> (w_fp8, scale): per output channel, scale [E, N]; block-wise,
    scale [E, ceil(N / bn), ceil(K / bk)], the amax of each block over 448."""
    if block_shape is None:
        scale = w.abs().amax(-1) / FP8_MAX  # [E, N]
        return (w / scale[..., None]).to(FP8_DTYPE), scale
    bn, bk = block_shape
    scale = torch.stack([
        torch.stack([block.abs().amax((-2, -1)) for block in row.split(bk, dim=-1)], dim=-1)
        for row in w.split(bn, dim=-2)
    ], dim=-2) / FP8_MAX  # [E, ceil(N / bn), ceil(K / bk)]
    return (w / expand_scale(scale, w.shape, block_shape)).to(FP8_DTYPE), scale


def expand_scale(scale: torch.Tensor, shape: torch.Size, block_shape: tuple[int, int] | None) -> torch.Tensor:
    """A weight scale broadcast to the weight's [E, N, K]."""
    if block_shape is None:
        return scale[..., None].expand(shape)
    bn, bk = block_shape
    return scale.repeat_interleave(bn, dim=1)[:, : shape[1]].repeat_interleave(bk, dim=2)[:, :, : shape[2]]


# Tolerance against the reference that quantizes the activations the same way: the
# operands are the same e4m3 values and scales, except where float32 summation order
# (against the reference's float64) moves a 16-bit gate_up output across a rounding
# boundary of the dtype. That one-ulp change of an activation shifts its e4m3 value by
# one step (2^-4 to 2^-3 of it) when it also crosses an e4m3 rounding point (about 1 in
# 2^7 such changes for float16, 1 in 2^4 for bfloat16, 1 in 2^20 for float32), or
# rescales its whole row (group) when it is the amax. One step of one activation moves
# an output by 2^-3 |a_i w2[h, i]|, some 2^-3 / sqrt(I) ~ 2e-2 of the outputs' RMS here;
# the output's own rounding adds 2^-11 (float16) of itself. So: atol a multiple of the
# RMS of the expected output, rtol the dtype's rounding. Measured (6 seeds x 3 forms):
# max |error| / RMS 1.9e-6 for float32 activations and 6.0e-3 for float16 ones.
FP8_TOLERANCE = {  # dtype: (atol / RMS of the expected output, rtol)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1.5e-2, 2e-3),
    torch.bfloat16: (6e-2, 1.6e-2),
}
# Against the unquantized activations (the dequantized weights are exact either way):
# e4m3 rounding moves a normal value by at most 2^-4 of itself, ~0.027 RMS for Gaussian
# data (measured in test_triton_fp8.py), and the down projection sees two such errors,
# its own input's and the one propagated from gate_up through silu(gate) * up: about
# 0.04 of the output's norm. Measured 0.026-0.052 (6 seeds x 3 forms), checked at 0.07.
FP8_NORM_TOLERANCE = 0.07
FP8_FORMS = {
    # (block_shape, H, I, tiles): the block forms' K and N edges fall inside a scale block,
    # and BLOCK_K = 64 splits each 128 block into two tl.dots.
    "per_channel": (None, HIDDEN, INTER, TILES),
    "block_128": ((128, 128), 192, 160, {**TILES, "BLOCK_N": 64, "BLOCK_K": 64}),
    "block_32x16": ((32, 16), HIDDEN, INTER, TILES),  # BLOCK_K clamped to 16; N and K blocks differ
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", list(FP8_FORMS))
def test_fused_moe_fp8(form, dtype):
    block_shape, hidden, inter, tiles = FP8_FORMS[form]
    moe = make_case(11, 6, 2, torch.float32, seed=len(form), hidden=hidden, inter=inter)
    gen = torch.Generator().manual_seed(5)
    # Weights whose magnitude varies by channel and block, so that a scale misread shows.
    weights = []
    for w in (moe.w13.cpu(), moe.w2.cpu()):
        spread = torch.exp(torch.randn(w.shape[0], w.shape[1], 1, generator=gen) * 0.5)
        w = w * spread * torch.exp(torch.randn(1, 1, w.shape[2], generator=gen) * 0.5)
        w_fp8, scale = quantize_weights(w, block_shape)
        weights.append((w_fp8.to(DEVICE), scale.to(DEVICE), w_fp8.float() * expand_scale(scale, w.shape, block_shape)))
    (w13, w13_scale, w13_real), (w2, w2_scale, w2_real) = weights
    hidden_states = moe.hidden.to(dtype)

    out = fused_moe(hidden_states, w13, w2, moe.topk_weights, moe.topk_ids, w13_scale=w13_scale,
                    w2_scale=w2_scale, block_shape=block_shape, config=tiles)
    assert out.shape == hidden_states.shape and out.dtype == dtype
    def quantize(x: torch.Tensor) -> torch.Tensor:  # per token: a group of the whole row (H, then I)
        return quant_dequant(x, x.shape[-1] if block_shape is None else block_shape[1])

    args = (hidden_states, w13_real, w2_real, moe.topk_weights, moe.topk_ids, dtype)
    expected = reference_moe(*args, quantize=quantize)
    atol, rtol = FP8_TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), expected, atol=atol * expected.pow(2).mean().sqrt().item(),
                               rtol=rtol)
    unquantized = reference_moe(*args)
    assert (out.double().cpu() - unquantized).norm() <= FP8_NORM_TOLERANCE * unquantized.norm()


# ------------------------------------------------------------------ tile configs
def test_moe_config_defaults_without_a_file(tmp_path):
    small = moe_config(1, 128, 2048, 768, torch.bfloat16, "NVIDIA H200", config_dir=tmp_path)
    large = moe_config(4096, 128, 2048, 768, torch.bfloat16, "NVIDIA H200", config_dir=tmp_path)
    assert set(small) == set(large) == set(CONFIG_KEYS)
    assert small["BLOCK_M"] == 16 and large["BLOCK_M"] == 128
    assert default_moe_config(8, "fp8_w8a8_block_128x128")["BLOCK_K"] == 128


def test_moe_config_picks_the_nearest_bucket(tmp_path):
    buckets = {size: {**TILES, "BLOCK_M": block_m} for size, block_m in ((1, 16), (64, 32), (1024, 128))}
    name = moe_config_file_name(128, 2048, 768, moe_dtype_name(FP8_DTYPE, (128, 128)), "NVIDIA H200")
    assert name == "E=128,H=2048,I=768,device=NVIDIA_H200,dtype=fp8_w8a8_block_128x128.json"
    (tmp_path / name).write_text(json.dumps({str(size): config for size, config in buckets.items()}))

    def block_m(num_tokens: int) -> int:
        return moe_config(num_tokens, 128, 2048, 768, "fp8_w8a8_block_128x128", "NVIDIA H200",
                          config_dir=tmp_path)["BLOCK_M"]

    assert [block_m(n) for n in (1, 2, 40, 64, 500, 600, 10**5)] == [16, 16, 32, 32, 32, 128, 128]
    assert moe_dtype_name(torch.bfloat16) == "bfloat16" and moe_dtype_name(FP8_DTYPE) == "fp8_w8a8"


def test_moe_config_rejects_a_malformed_file(tmp_path):
    name = moe_config_file_name(8, 4096, 14336, "bfloat16", "NVIDIA H200")
    (tmp_path / name).write_text(json.dumps({"1": {"BLOCK_M": 16}}))
    with pytest.raises(ValueError, match="exactly the keys"):
        moe_config(1, 8, 4096, 14336, torch.bfloat16, "NVIDIA H200", config_dir=tmp_path)


# ------------------------------------------------------------------ CUDA graphs (GPU only)
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fp8_block_case(num_tokens: int, seed: int) -> tuple[MoeCase, dict]:
    moe = make_case(num_tokens, 16, 4, torch.float32, seed=seed, hidden=256, inter=128)
    (w13, w13_scale), (w2, w2_scale) = (quantize_weights(w, (128, 128)) for w in (moe.w13, moe.w2))
    moe.hidden = moe.hidden.bfloat16()
    return moe, dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale, block_shape=(128, 128))


@cuda_only
@pytest.mark.parametrize("form", ["bfloat16", "fp8_block"])
def test_fused_moe_never_syncs_with_the_host(form):
    if form == "fp8_block":
        moe, weights = fp8_block_case(64, seed=1)
    else:
        moe = make_case(64, 16, 4, torch.bfloat16, seed=1, hidden=256, inter=128)
        weights = dict(w13=moe.w13, w2=moe.w2)

    def run() -> torch.Tensor:
        moe_align_block_size(moe.topk_ids, 16, 16)
        return fused_moe(moe.hidden, topk_weights=moe.topk_weights, topk_ids=moe.topk_ids, **weights)

    run()  # compiles, and reads the device name, outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@cuda_only
@pytest.mark.parametrize("form", ["bfloat16", "fp8_block"])
def test_fused_moe_replays_in_a_cuda_graph(form):
    """Captured once, replayed on new hidden states and new routing: the graph's output
    is the eager call's on the same inputs, bit for bit (the same kernels and tiles)."""
    if form == "fp8_block":
        (moe, weights), (fresh, _) = fp8_block_case(48, seed=2), fp8_block_case(48, seed=3)
    else:
        moe = make_case(48, 16, 4, torch.bfloat16, seed=2, hidden=256, inter=128)
        fresh = make_case(48, 16, 4, torch.bfloat16, seed=3, hidden=256, inter=128)
        weights = dict(w13=moe.w13, w2=moe.w2)
    hidden, topk_weights, topk_ids = moe.hidden.clone(), moe.topk_weights.clone(), moe.topk_ids.clone()

    def run() -> torch.Tensor:
        return fused_moe(hidden, topk_weights=topk_weights, topk_ids=topk_ids, **weights)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm: compiled before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    hidden.copy_(fresh.hidden)
    topk_weights.copy_(fresh.topk_weights)
    topk_ids.copy_(fresh.topk_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())
    if form == "bfloat16":
        expected = reference_moe(hidden, moe.w13, moe.w2, topk_weights, topk_ids, torch.bfloat16)
        assert_matches(out, expected, TOLERANCE[torch.bfloat16])
