"""FP8 kernels (engine/kernels/triton_fp8.py) and layers (engine/model/fp8.py) against plain torch.

Without CUDA the kernels run on CPU tensors under Triton's interpreter, switched on
before the kernel modules are imported. Three kinds of check:

- quantization is exact: the same scales and the same e4m3 bits as torch's
  `(x / scale).clamp(±448).to(float8_e4m3fn)`;
- the GEMMs match float32 matmuls of the dequantized operands up to float32
  summation order;
- against the unquantized product, the error is what e4m3 rounding predicts (below).

Error of a quantized dot product. e4m3 keeps 3 mantissa bits, so rounding moves a
normal value by at most u = 2^-4 of itself (measured: 1/17 = u / (1 + u)), and a
subnormal one (below 2^-6 of the scale) by at most 2^-10 of the scale. Hence, for
every output element, with both operands quantized,

    |out - ref| <= (2u + u^2) * sum_k |x_k| |w_k|  + subnormal terms      (always)

For Gaussian data the roundings are close to independent with an RMS relative size
of rho ~ 0.0266 (measured; u / sqrt(3) is 0.036 for a uniform error, and mantissas
near 2 are rounded relatively less), so each output's error is a random sum: its
norm over the output is sqrt(2) * rho ~ 0.0376 of the output's norm, whatever K
(measured 0.035-0.038 for K = 64..4096, checked below at 0.045), and relative to
sum_k |x_k w_k| it falls as 1/sqrt(K): the mean ratio measures 0.044 / sqrt(K),
checked below at 2^-4 / sqrt(K).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.envs import use_triton_interpreter

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    use_triton_interpreter()

from engine.kernels.triton_fp8 import (  # noqa: E402
    block_fp8_matmul,
    channel_fp8_matmul,
    per_token_group_quant_fp8,
    per_token_quant_fp8,
)
from engine.model.fp8 import (  # noqa: E402
    FP8_MAX,
    QUANT_EPS,
    Fp8Linear,
    dequantize_fp8,
    quantize_fp8,
    quantize_linear_layers,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
# Output dtypes: the interpreter's float32 -> bfloat16 cast mis-rounds (it drops a rounded-up
# mantissa's carry into the exponent), so bfloat16 outputs only on a GPU. Inputs may be bfloat16.
OUT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
IN_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative size of the one rounding of an output to its dtype.
OUT_ROUNDING = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
U = 2.0**-4  # e4m3's unit roundoff
# (M, N, K): decode, edges of every tile, K not a multiple of 128.
SHAPES = [(1, 200, 300), (17, 64, 128), (70, 136, 200)]


def randn(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def torch_quant(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: scale = max(amax, eps) / 448 per row group, values x / scale
    clamped and cast (torch rounds to nearest even)."""
    num_rows, num_cols = x.shape
    num_groups = math.ceil(num_cols / group_size)
    padded = torch.zeros(num_rows, num_groups * group_size, device=x.device)
    padded[:, :num_cols] = x.float()
    groups = padded.view(num_rows, num_groups, group_size)
    scale = groups.abs().amax(dim=-1).clamp(min=QUANT_EPS) / FP8_MAX  # [M, G]
    values = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.view(num_rows, -1)[:, :num_cols], scale


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def dequantize_groups(x_fp8: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    return dequantize_fp8(x_fp8, scale, (1, group_size))


# Hopper's fp8 tensor cores add with ~14 significant bits, truncating (DeepSeek-V3 report,
# 3.3.2); the kernels promote to float32 every 128 products, so the error is at most 32
# products' truncation (one 32-deep MMA: 32 * 2^-13 = 2^-8 of the largest) for each of the
# partial sums: <= 2^-8 of sum_k |a_k w_k| in the worst case. Under the interpreter, 0.
MMA_ACCUMULATION = 2.0**-8 if DEVICE == "cuda" else 0.0


def summation_bound(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(gamma_K + mma) * sum_k |a_k w_k|, gamma_K ~ K * 2^-24 (doubled for slack): how far
    any two float32 summation orders of the same products (and the scale products) may fall
    apart, plus the tensor cores' reduced-precision accumulation on a GPU. Measured under the
    interpreter: 2e-7 of sum_k |a_k w_k| at most, for K = 64..1024."""
    num_terms = a.shape[1] + 4
    return (2 * num_terms * 2.0**-24 + MMA_ACCUMULATION) * (a.abs() @ w.abs().T)


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    excess = (out.float() - ref).abs() - bound
    assert excess.max().item() <= 0, f"error exceeds its bound by {excess.max().item():.3g}"


# --- quantization: exact ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (5, 300), (3, 5000)])  # 5000: a row walked in two chunks
def test_per_token_quant_matches_torch(shape, dtype):
    x = randn(*shape, dtype=dtype) * 3
    x_fp8, scale = per_token_quant_fp8(x)
    ref_fp8, ref_scale = torch_quant(x, shape[1])
    assert x_fp8.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (shape[0], 1)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(bits(x_fp8), bits(ref_fp8))


def test_quant_rounds_every_e4m3_value_and_tie_to_even():
    """With amax 448 the scale is 1, so each input is rounded as it is: every finite e4m3
    value, every midpoint between neighbours (ties: to even), the floats on either side
    of each midpoint, subnormals, signed zero and a float32 too small for e4m3."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    codes = codes[codes.isfinite()].unique()  # sorted, one zero
    midpoints = (codes[1:] + codes[:-1]) / 2
    above = torch.nextafter(midpoints, torch.full_like(midpoints, math.inf))
    below = torch.nextafter(midpoints, torch.full_like(midpoints, -math.inf))
    extra = torch.tensor([FP8_MAX, -0.0, 1e-30, -1e-45, 447.99])
    x = torch.cat([codes, midpoints, above, below, extra]).unsqueeze(0).to(DEVICE)
    x_fp8, scale = per_token_quant_fp8(x)
    assert scale.item() == 1.0
    assert torch.equal(bits(x_fp8), bits(x.to(FP8)))


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("group_size", [128, 64, 48])
def test_per_token_group_quant_matches_torch(group_size, dtype):
    x = randn(9, 300, dtype=dtype)  # a partial last group
    x[2, :group_size] = 0  # an all-zero group: the eps scale, zero values
    x_fp8, scale = per_token_group_quant_fp8(x, group_size)
    ref_fp8, ref_scale = torch_quant(x, group_size)
    assert scale.shape == (9, math.ceil(300 / group_size))
    assert torch.equal(scale, ref_scale)
    assert scale[2, 0].item() == pytest.approx(QUANT_EPS / FP8_MAX)
    assert torch.equal(bits(x_fp8), bits(ref_fp8))


def test_quant_of_no_rows():
    x_fp8, scale = per_token_group_quant_fp8(torch.empty(0, 256, device=DEVICE))
    assert x_fp8.shape == (0, 256) and scale.shape == (0, 2)


# --- GEMMs against the dequantized operands: float32 summation order only --------------------


def block_operands(num_rows: int, num_out: int, num_cols: int, block: tuple[int, int], seed: int = 0):
    """Activations quantized per token group of bk, a weight quantized per (bn, bk) block."""
    x = randn(num_rows, num_cols, seed=seed)
    w = randn(num_out, num_cols, seed=seed + 1)
    a_fp8, a_scale = per_token_group_quant_fp8(x, block[1])
    w_fp8, w_scale = quantize_fp8(w, "block", block)
    return x, w, a_fp8, a_scale, w_fp8, w_scale


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_block_fp8_matmul_matches_dequantized(shape, out_dtype):
    num_rows, num_out, num_cols = shape
    block = (128, 128)
    _, _, a_fp8, a_scale, w_fp8, w_scale = block_operands(num_rows, num_out, num_cols, block)
    bias = randn(num_out, seed=5).to(out_dtype)
    out = block_fp8_matmul(a_fp8, a_scale, w_fp8, w_scale, block, out_dtype, bias)
    assert out.shape == (num_rows, num_out) and out.dtype == out_dtype
    a = dequantize_groups(a_fp8, a_scale, block[1])
    w = dequantize_fp8(w_fp8, w_scale, block)
    ref = a @ w.T + bias.float()
    assert_within(out, ref, summation_bound(a, w) + OUT_ROUNDING[out_dtype] * ref.abs())


@pytest.mark.parametrize("block", [(64, 128), (128, 64), (32, 32)])
def test_block_fp8_matmul_other_block_sizes(block):
    _, _, a_fp8, a_scale, w_fp8, w_scale = block_operands(5, 100, 200, block)
    out = block_fp8_matmul(a_fp8, a_scale, w_fp8, w_scale, block, torch.float32)
    a = dequantize_groups(a_fp8, a_scale, block[1])
    w = dequantize_fp8(w_fp8, w_scale, block)
    assert_within(out, a @ w.T, summation_bound(a, w))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_channel_fp8_matmul_matches_dequantized(shape, out_dtype):
    num_rows, num_out, num_cols = shape
    a_fp8, a_scale = per_token_quant_fp8(randn(num_rows, num_cols))
    w_fp8, w_scale = quantize_fp8(randn(num_out, num_cols, seed=1), "channel")
    a = dequantize_fp8(a_fp8, a_scale)
    w = dequantize_fp8(w_fp8, w_scale)
    for scale, bias in ((w_scale, None), (w_scale[:, None], randn(num_out, seed=5).to(out_dtype))):
        out = channel_fp8_matmul(a_fp8, a_scale, w_fp8, scale, out_dtype, bias)
        assert out.shape == (num_rows, num_out) and out.dtype == out_dtype
        ref = a @ w.T + (0 if bias is None else bias.float())
        assert_within(out, ref, summation_bound(a, w) + OUT_ROUNDING[out_dtype] * ref.abs())


# --- GEMMs against the unquantized product: e4m3's rounding error ----------------------------


@pytest.mark.parametrize("kind", ["block", "channel"])
@pytest.mark.parametrize("num_cols", [64, 300, 1024])
def test_fp8_matmul_error_against_unquantized(kind, num_cols):
    """The bounds of the module docstring: the worst case for every element, and the
    statistical size of the error for Gaussian data (norm-wise and by K)."""
    num_rows, num_out = 16, 128
    x = randn(num_rows, num_cols, seed=2)
    w = randn(num_out, num_cols, seed=3)
    if kind == "block":
        a_fp8, a_scale = per_token_group_quant_fp8(x, 128)
        w_fp8, w_scale = quantize_fp8(w, "block", (128, 128))
        out = block_fp8_matmul(a_fp8, a_scale, w_fp8, w_scale, (128, 128), torch.float32)
    else:
        a_fp8, a_scale = per_token_quant_fp8(x)
        w_fp8, w_scale = quantize_fp8(w, "channel")
        out = channel_fp8_matmul(a_fp8, a_scale, w_fp8, w_scale, torch.float32)
    subnormal_x, subnormal_w = a_scale.amax(), w_scale.amax()
    ref = x @ w.T
    magnitude = x.abs() @ w.abs().T  # sum_k |x_k w_k|, [M, N]
    error = (out - ref).abs()
    # An operand rounded as a subnormal errs by up to 2^-10 of its scale rather than u of itself;
    # its term then errs by that times the other operand (doubled: that one's rounding, slack).
    subnormal = 2.0**-10 * (subnormal_x * w.abs().sum(1)[None, :] + subnormal_w * x.abs().sum(1)[:, None])
    worst_case = (2 * U + U * U) * magnitude + 2 * subnormal + summation_bound(x, w)
    assert (error <= worst_case).all()
    normwise = (error.norm() / ref.norm()).item()
    assert normwise <= 0.045, normwise  # expected sqrt(2) * 0.0266 = 0.0376
    mean_ratio = (error / magnitude).mean().item()
    assert mean_ratio <= U / math.sqrt(num_cols), mean_ratio  # expected 0.044 / sqrt(K)


# --- quantize / dequantize -------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_quantize_dequantize_round_trip(strategy):
    w = randn(200, 300, seed=4) * torch.linspace(0.1, 10, 200, device=DEVICE)[:, None]
    block = (128, 128)
    w_fp8, scale = quantize_fp8(w, strategy, block)
    expected_shape = {"channel": (200,), "tensor": (1,), "block": (2, 3)}[strategy]
    assert w_fp8.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == expected_shape
    # Every scale maps its group's amax to (about) 448: the full e4m3 range is used.
    assert w_fp8.float().abs().max().item() == FP8_MAX
    restored = dequantize_fp8(w_fp8, scale, block if strategy == "block" else None)
    # Within half an e4m3 ulp: u of the value when normal, 2^-10 of the scale when subnormal.
    scale_max = scale.amax().item()
    assert ((restored - w).abs() <= U * w.abs() + 2.0**-10 * scale_max).all()
    # Quantizing the restored weight again reproduces it (its values are on the grid).
    again_fp8, again_scale = quantize_fp8(restored, strategy, block)
    assert torch.equal(dequantize_fp8(again_fp8, again_scale, block if strategy == "block" else None), restored)


def test_dequantize_layouts_are_exact():
    w_fp8, _ = quantize_fp8(randn(130, 260, seed=6), "channel")
    values = w_fp8.float()
    per_channel = torch.rand(130, device=DEVICE) + 0.5
    assert torch.equal(dequantize_fp8(w_fp8, torch.tensor(0.25, device=DEVICE)), values * 0.25)
    assert torch.equal(dequantize_fp8(w_fp8, torch.tensor([0.25], device=DEVICE)), values * 0.25)
    assert torch.equal(dequantize_fp8(w_fp8, per_channel), values * per_channel[:, None])
    assert torch.equal(dequantize_fp8(w_fp8, per_channel[:, None]), values * per_channel[:, None])
    blocks = torch.rand(2, 3, device=DEVICE) + 0.5  # the last row and column of blocks cropped
    expected = torch.empty_like(values)
    for i in range(2):
        for j in range(3):
            expected[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (
                values[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] * blocks[i, j]
            )
    assert torch.equal(dequantize_fp8(w_fp8, blocks, (128, 128)), expected)
    with pytest.raises(ValueError):
        dequantize_fp8(w_fp8, blocks)


# --- Fp8Linear -------------------------------------------------------------------------------


def linear_reference(layer: Fp8Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 product of the layer's dequantized weight and the quantized-then-dequantized x,
    and its summation bound."""
    x2 = x.reshape(-1, layer.in_features)
    if layer.block_size is None:
        a = dequantize_fp8(*per_token_quant_fp8(x2))
    else:
        a = dequantize_groups(*per_token_group_quant_fp8(x2, layer.block_size[1]), layer.block_size[1])
    w = dequantize_fp8(layer.weight, layer.weight_scale, layer.block_size)
    ref = a @ w.T + (0 if layer.bias is None else layer.bias.float())
    return ref, summation_bound(a, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [None, (128, 128)])
def test_fp8_linear_forward(block_size, dtype):
    weight = randn(136, 200, seed=7)
    bias = randn(136, seed=8).to(dtype)
    if block_size is None:
        layer = Fp8Linear.quantize(weight, bias)
    else:
        layer = Fp8Linear.from_weights(*quantize_fp8(weight, "block", block_size), bias, block_size)
    assert (layer.in_features, layer.out_features) == (200, 136)
    x = randn(2, 3, 200, seed=9).to(dtype)  # leading dims are flattened and restored
    out = layer(x)
    assert out.shape == (2, 3, 136) and out.dtype == dtype
    ref, bound = linear_reference(layer, x)
    assert_within(out.reshape(6, 136), ref, bound + OUT_ROUNDING[dtype] * ref.abs())
    if DEVICE == "cpu":
        assert layer._use_scaled_mm in (None, False)


def test_fp8_linear_from_per_tensor_scale():
    w_fp8, scale = quantize_fp8(randn(64, 96, seed=10), "tensor")
    layer = Fp8Linear.from_weights(w_fp8, scale.reshape(()))
    assert layer.weight_scale.shape == (64,) and (layer.weight_scale == scale).all()
    x = randn(4, 96, seed=11)
    ref, bound = linear_reference(layer, x)
    assert_within(layer(x), ref, bound)


def test_quantize_linear_layers_replaces_cuda_linears_only():
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16, bias=False))
    model.to(DEVICE)
    replaced = quantize_linear_layers(model)
    if DEVICE == "cpu":
        assert replaced == 0 and isinstance(model[0], torch.nn.Linear)
    else:
        assert replaced == 2 and isinstance(model[0], Fp8Linear) and isinstance(model[2], Fp8Linear)
        assert model[0].bias is not None and model[2].bias is None


@pytest.mark.skipif(DEVICE != "cuda", reason="torch._scaled_mm needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 33, 256])
def test_fp8_linear_scaled_mm_matches_triton(num_rows):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9")
    weight = randn(512, 1024, seed=12).to(torch.bfloat16)
    bias = randn(512, seed=13).to(torch.bfloat16)
    fast = Fp8Linear.quantize(weight, bias)
    triton_path = Fp8Linear.quantize(weight, bias)
    triton_path._use_scaled_mm = False
    x = randn(num_rows, 1024, seed=14).to(torch.bfloat16)
    out = fast(x)
    assert fast._use_scaled_mm is True
    expected = triton_path(x)
    ref, bound = linear_reference(fast, x)
    # Each within its bfloat16 rounding of the float32 reference, so within two of each other.
    for result in (out, expected):
        assert_within(result, ref, bound + 2.0**-8 * ref.abs())
    assert_within(out, expected.float(), 2 * bound + 2.0**-7 * ref.abs())
