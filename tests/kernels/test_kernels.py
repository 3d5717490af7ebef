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


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("hidden", [64, 576, 37])  # whole vectors of 16, and a tail
def test_grouped_matmul_matches_a_matmul_per_expert(hidden, num_threads):
    """Experts with no row, one row, a tile's worth and more (tails of 1-3 rows), output
    widths that leave a tile tail, against each group's rows times its expert in float64."""
    gen = torch.Generator().manual_seed(4)
    counts = [0, 1, 4, 7, 0, 13, 2, 0]
    width = 70  # 17 tiles of 4 and a tail of 2; one task of 64 weight rows and one of 6
    rows = torch.randn(sum(counts), hidden, generator=gen)
    weight = torch.randn(len(counts), width, hidden, generator=gen)
    offsets = torch.tensor([0, *counts]).cumsum(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = kernels.grouped_matmul(rows, weight, offsets)
    finally:
        torch.set_num_threads(previous)
    expected = torch.cat([rows[offsets[e]:offsets[e + 1]].double() @ weight[e].double().t()
                          for e in range(len(counts))])
    assert out.shape == (sum(counts), width) and out.dtype == torch.float32
    # float32 sums of `hidden` products, in another order than the reference's.
    torch.testing.assert_close(out.double(), expected, atol=1e-5 * hidden ** 0.5, rtol=1e-5)


def test_grouped_matmul_refuses_offsets_that_do_not_cover_the_rows():
    rows, weight = torch.zeros(5, 16), torch.zeros(2, 8, 16)
    with pytest.raises(RuntimeError, match="offsets must run from 0"):
        kernels.grouped_matmul(rows, weight, torch.tensor([0, 2, 4]))
    with pytest.raises(RuntimeError, match="offsets must not decrease"):
        kernels.grouped_matmul(rows, weight, torch.tensor([0, 6, 5]))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.grouped_matmul(rows.double(), weight, torch.tensor([0, 2, 5]))


def test_the_cpu_ops_group_experts_natively_in_float32_only():
    """float64 keeps a torch.mm per expert: those runs are for exactness against transformers."""
    from engine.model.ops import select_ops

    assert select_ops("cpu", torch.float32).grouped_matmul is kernels.grouped_matmul
    assert select_ops("cpu", torch.float64).grouped_matmul is None
