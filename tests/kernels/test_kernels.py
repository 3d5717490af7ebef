"""Native CPU ops (engine/kernels/cpu_ops.cpp) against the eager torch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.model.llama import RMSNorm, apply_rotary



@pytest.fixture(autouse=True, scope="module")
def cpu_kernels():
    """Built (or loaded) for these tests, not when the module is imported."""
    kernels.load_cpu_kernels()

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_rotary_matches_eager_bitwise(dtype, num_threads):
    gen = torch.Generator().manual_seed(0)
    num_tokens, heads, rotated_heads, head_dim = 37, 7, 5, 64
    qkv = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 6
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    expected = apply_rotary(qkv[:, :rotated_heads], cos, sin)
    untouched = qkv[:, rotated_heads:].clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        kernels.rotary_embedding_(qkv, cos, sin, rotated_heads)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(qkv[:, :rotated_heads], expected)
    assert torch.equal(qkv[:, rotated_heads:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_eager(dtype):
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(300, 2 * 96, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = kernels.silu_and_mul(gate_up)
    assert out.shape == (300, 96) and out.dtype == dtype
    # exp is libm's here and torch's vectorised one in eager mode: ulp-level differences.
    tolerance = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_eager(dtype):
    gen = torch.Generator().manual_seed(2)
    hidden = (torch.randn(129, 576, generator=gen) * 3).to(dtype)
    norm = RMSNorm(576, 1e-5)
    norm.weight = torch.nn.Parameter(torch.randn(576, generator=gen).to(dtype))
    expected = norm(hidden)
    out = kernels.rms_norm(hidden, norm.weight, 1e-5)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


def test_rms_norm_reads_strided_rows_and_rejects_bad_weights():
    hidden = torch.randn(8, 2, 64)[:, 0]  # rows 128 elements apart
    norm = RMSNorm(64, 1e-6)
    norm.weight = torch.nn.Parameter(torch.rand(64) + 0.5)
    torch.testing.assert_close(kernels.rms_norm(hidden, norm.weight, 1e-6), norm(hidden), atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(hidden, torch.ones(32), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_matches_torch_including_ties_and_nan(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 1000, generator=gen).to(dtype)
    logits[1, [10, 500, 999]] = 50.0  # ties: the first index wins
    logits[2, :] = 1.0  # all equal
    logits[3, 0] = 99.0  # the first element
    logits[4, -1] = 99.0  # the last element
    logits[5, [7, 400]] = float("nan")  # NaN wins, the first one
    logits[6, 0] = float("nan")
    logits[7, :] = float("-inf")
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1))
    strided = torch.randn(4, 2, 300, generator=gen).to(dtype)[:, 1]
    assert torch.equal(kernels.argmax_rows(strided), strided.argmax(dim=-1))


def experts_loop(hidden, expert_ids, weights, gate_up, down):
    """transformers' Qwen3MoeExperts / MixtralExperts forward in float64: a loop over the
    experts, each one's tokens through gate/up, SiLU, down, times their weights, added in
    ascending expert order."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    inter = gate_up.shape[1] // 2
    for expert in range(gate_up.shape[0]):
        tokens, slots = torch.where(expert_ids == expert)
        if len(tokens):
            x = hidden[tokens].double()
            gate, up = x @ gate_up[expert, :inter].double().t(), x @ gate_up[expert, inter:].double().t()
            y = (F.silu(gate) * up) @ down[expert].double().t()
            out.index_add_(0, tokens, y * weights[tokens, slots].double()[:, None])
    return out


def moe_case(tokens, hidden, inter, experts, top_k, seed=6, counts=None):
    """Random tokens, routing (top_k distinct experts each, or `counts` tokens per expert
    at top_k 1) and expert weights scaled to keep activations near 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    if counts is None:
        probs = torch.softmax(torch.randn(tokens, experts, generator=gen), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        ids = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))[torch.randperm(tokens, generator=gen)]
        ids, weights = ids[:, None], torch.rand(tokens, 1, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    return x, ids, weights.contiguous(), gate_up, down


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [
    (1, 64, 32, 8, 2),      # batch 1: two experts of one token, six with none
    (32, 576, 768, 8, 2),   # the CPU benchmark's layer at batch 32
    (70, 37, 21, 8, 8),     # every expert gets every token; widths that leave panel tails
    (19, 48, 40, 5, 3),     # 57 slots: tiles of 8 and tails of 1 to 7 rows
])
def test_moe_experts_match_the_experts_loop(tokens, hidden, inter, experts, top_k, num_threads):
    x, ids, weights, gate_up, down = moe_case(tokens, hidden, inter, experts, top_k)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = kernels.moe_experts(x, ids, weights, *kernels.pack_moe_weights(gate_up, down), inter)
    finally:
        torch.set_num_threads(previous)
    assert out.shape == x.shape and out.dtype == torch.float32
    # float32 sums of `hidden` then `inter` products, in another order than the reference's.
    torch.testing.assert_close(out.double(), experts_loop(x, ids, weights, gate_up, down),
                               atol=2e-6 * (hidden + inter) ** 0.5, rtol=1e-5)


def test_moe_experts_with_empty_one_token_and_all_token_experts():
    """Expert 0 gets every token but nine, 1 and 3 get none, 2 gets one, at top-1."""
    counts = [31, 0, 1, 0, 8]
    x, ids, weights, gate_up, down = moe_case(sum(counts), 96, 64, len(counts), 1, counts=counts)
    out = kernels.moe_experts(x, ids, weights, *kernels.pack_moe_weights(gate_up, down), 64)
    torch.testing.assert_close(out.double(), experts_loop(x, ids, weights, gate_up, down), atol=3e-5, rtol=1e-5)


def test_pack_moe_weights_lays_out_panels_of_16_gate_then_16_up_columns():
    experts, hidden, inter = 2, 5, 20  # gate/up: two panels, the second half empty; down: one panel, 27 empty
    gate_up = torch.arange(experts * 2 * inter * hidden, dtype=torch.float32).reshape(experts, 2 * inter, hidden)
    down = torch.arange(experts * hidden * inter, dtype=torch.float32).reshape(experts, hidden, inter)
    packed_gate_up, packed_down = kernels.pack_moe_weights(gate_up, down)
    assert packed_gate_up.shape == (experts, 2, hidden, 32) and packed_down.shape == (experts, 1, inter, 32)
    e, k = 1, 3
    assert torch.equal(packed_gate_up[e, 0, k, :16], gate_up[e, :16, k])             # gate columns 0-15
    assert torch.equal(packed_gate_up[e, 0, k, 16:], gate_up[e, inter:inter + 16, k])  # up columns 0-15
    assert torch.equal(packed_gate_up[e, 1, k, :4], gate_up[e, 16:20, k])
    assert torch.equal(packed_gate_up[e, 1, k, 16:20], gate_up[e, inter + 16:, k])
    assert not packed_gate_up[:, 1, :, 4:16].any() and not packed_gate_up[:, 1, :, 20:].any()
    assert torch.equal(packed_down[e, 0, k, :hidden], down[e, :, k]) and not packed_down[:, :, :, hidden:].any()


def test_moe_experts_refuse_what_would_read_out_of_bounds():
    x, ids, weights, gate_up, down = moe_case(4, 32, 16, 4, 2)
    packed = kernels.pack_moe_weights(gate_up, down)
    with pytest.raises(RuntimeError, match=r"expert id 4 is not in \[0, 4\)"):
        kernels.moe_experts(x, torch.full_like(ids, 4), weights, *packed, 16)
    with pytest.raises(RuntimeError, match="packed by pack_moe_weights"):
        kernels.moe_experts(x, ids, weights, gate_up, down, 16)
    with pytest.raises(RuntimeError, match="packed by pack_moe_weights"):
        kernels.moe_experts(x, ids, weights, *packed, 24)  # another width than the packing's
    with pytest.raises(RuntimeError, match="float32"):
        kernels.moe_experts(x.double(), ids, weights, *packed, 16)


def test_the_cpu_ops_run_experts_natively_in_float32_only():
    """float64 keeps a torch.mm per expert: those runs are for exactness against transformers."""
    from engine.model.ops import select_ops

    assert select_ops("cpu", torch.float32).moe_experts is kernels.moe_experts
    assert select_ops("cpu", torch.float32).pack_moe_weights is kernels.pack_moe_weights
    assert select_ops("cpu", torch.float64).moe_experts is None
