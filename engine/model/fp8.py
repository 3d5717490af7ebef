"""FP8 (float8_e4m3fn) weights for linear layers: quantize and dequantize them, and
`Fp8Linear`, the layer that multiplies by them.

A weight W [N, K] is stored as W_fp8 with a float32 scale that MULTIPLIES it
(W ≈ W_fp8 * scale: the `weight_scale_inv` of Qwen's and DeepSeek's checkpoints),
the scale one of

    per tensor   scalar or [1]
    per channel  [N] or [N, 1]                   one scale per output row
    per block    [ceil(N / bn), ceil(K / bk)]    one per (bn, bk) tile, edge tiles cropped

`Fp8Linear` keeps per-channel or per-block scales (a per-tensor scale is the same
scale in every channel) and quantizes its input per token on the fly:

    per channel  x -> per_token_quant_fp8 -> torch._scaled_mm (row-wise scales, CUDA sm_89+,
                                             bfloat16 out) or else channel_fp8_matmul
    per block    x -> per_token_group_quant_fp8 (groups of bk) -> block_fp8_matmul

`quantize_linear_layers` is what `--quantization fp8` does to a 16-bit checkpoint at
load: per-channel weights, dynamic per-token activations (vLLM's flag does the same).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# Floor of an amax: an all-zero channel or block gets a tiny scale, not 0.
QUANT_EPS = 1e-10

QuantStrategy = Literal["channel", "tensor", "block"]


def _expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block_size: tuple[int, int]) -> torch.Tensor:
    """[ceil(N / bn), ceil(K / bk)] -> [N, K]: each scale over its tile, the edge tiles cropped."""
    block_n, block_k = block_size
    num_rows, num_cols = shape
    assert scale.shape == (-(-num_rows // block_n), -(-num_cols // block_k)), "block scale of the wrong shape"
    return scale.repeat_interleave(block_n, 0).repeat_interleave(block_k, 1)[:num_rows, :num_cols]


def dequantize_fp8(
    weight_fp8: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # scalar / [1], [N] / [N, 1], or [ceil(N / bn), ceil(K / bk)]
    block_size: tuple[int, int] | None = None,  # (bn, bk), for block scales only
) -> torch.Tensor:
    """weight_fp8 * scale in float32 [N, K], exactly (an e4m3 value is exact in float32,
    and so is the one product rounded)."""
    num_rows, num_cols = weight_fp8.shape
    values = weight_fp8.to(torch.float32)
    scale = scale.to(torch.float32)
    if block_size is not None:
        return values * _expand_block_scale(scale, (num_rows, num_cols), block_size)
    if scale.numel() == 1:
        return values * scale.reshape(())
    if scale.shape in ((num_rows,), (num_rows, 1)):
        return values * scale.reshape(num_rows, 1)
    raise ValueError(f"a scale of shape {tuple(scale.shape)} needs a block_size for a weight of {num_rows, num_cols}")


def quantize_fp8(
    weight: torch.Tensor,  # [N, K] float
    strategy: QuantStrategy = "channel",
    block_size: tuple[int, int] = (128, 128),
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight -> (weight_fp8 [N, K], scale float32), scale = amax / 448 over each channel
    ([N]), the tensor ([1]) or each (bn, bk) block ([ceil(N / bn), ceil(K / bk)]),
    values = weight / scale clamped to ±448 and rounded to nearest even."""
    num_rows, num_cols = weight.shape
    weight = weight.to(torch.float32)
    if strategy == "channel":
        amax = weight.abs().amax(dim=1)  # [N]
        scale = amax.clamp(min=QUANT_EPS) / FP8_MAX
        expanded = scale[:, None]
    elif strategy == "tensor":
        scale = (weight.abs().amax().clamp(min=QUANT_EPS) / FP8_MAX).reshape(1)
        expanded = scale
    elif strategy == "block":
        block_n, block_k = block_size
        num_block_rows, num_block_cols = -(-num_rows // block_n), -(-num_cols // block_k)
        # Zero padding to whole blocks leaves every amax as it is.
        padded = weight.new_zeros(num_block_rows * block_n, num_block_cols * block_k)
        padded[:num_rows, :num_cols] = weight.abs()
        amax = padded.view(num_block_rows, block_n, num_block_cols, block_k).amax(dim=(1, 3))
        scale = amax.clamp(min=QUANT_EPS) / FP8_MAX
        expanded = _expand_block_scale(scale, (num_rows, num_cols), block_size)
    else:
        raise ValueError(f"unknown fp8 quantization strategy {strategy!r}")
    weight_fp8 = (weight / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return weight_fp8, scale


def can_use_scaled_mm(device: torch.device, dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    """Whether torch._scaled_mm takes row-wise (per-token x per-channel) scales here:
    CUDA with fp8 tensor cores (compute capability 8.9+), bfloat16 output (the only
    one row-wise scaling has), and K and N multiples of 16 (cuBLASLt's fp8 layouts)."""
    return (
        device.type == "cuda"
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(device) >= (8, 9)
        and dtype == torch.bfloat16
        and in_features % 16 == 0
        and out_features % 16 == 0
    )


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in fp8 and x quantized per token (or per token and K group)
    on the fly; y in x's dtype, accumulated in float32.

    Buffers: `weight` [N, K] float8_e4m3fn; `weight_scale` [N] float32 (per channel) or
    [ceil(N / bn), ceil(K / bk)] (per block, `block_size` = (bn, bk)); `bias` [N] in the
    activation dtype or None. The choice between torch._scaled_mm and the Triton
    fallback is made once, at the first call, from that call's device and dtype.
    """

    def __init__(
        self,
        weight: torch.Tensor,  # [N, K] float8_e4m3fn
        weight_scale: torch.Tensor,  # [N] or [ceil(N / bn), ceil(K / bk)] float32
        bias: torch.Tensor | None = None,  # [N]
        block_size: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        assert weight.dim() == 2 and weight.dtype == FP8_DTYPE
        self.out_features, self.in_features = weight.shape
        self.block_size = block_size
        if block_size is None:
            assert weight_scale.shape == (self.out_features,), "per-channel scale must be [N]"
        else:
            block_n, block_k = block_size
            assert weight_scale.shape == (-(-self.out_features // block_n), -(-self.in_features // block_k))
        assert weight_scale.dtype == torch.float32 and (bias is None or bias.shape == (self.out_features,))
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.contiguous())
        self.register_buffer("bias", None if bias is None else bias.contiguous())
        self._use_scaled_mm: bool | None = None  # decided at the first call

    @classmethod
    def from_weights(
        cls,
        weight_fp8: torch.Tensor,  # [N, K] float8_e4m3fn
        scale: torch.Tensor,  # scalar / [1], [N] / [N, 1], or [ceil(N / bn), ceil(K / bk)]
        bias: torch.Tensor | None = None,
        block_size: tuple[int, int] | None = None,
    ) -> Fp8Linear:
        """An Fp8Linear for a checkpoint's fp8 weight and its scale (any of the three
        layouts; a per-tensor scale becomes the same per-channel scale everywhere)."""
        num_rows = weight_fp8.shape[0]
        scale = scale.to(device=weight_fp8.device, dtype=torch.float32)
        if block_size is None:
            if scale.numel() == 1:
                scale = scale.reshape(1).expand(num_rows)
            scale = scale.reshape(num_rows)
        return cls(weight_fp8, scale, bias, block_size)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
        """An Fp8Linear for a 16- or 32-bit weight [N, K], quantized per channel on its
        device (the online `--quantization fp8` path); the bias stays as it is."""
        weight_fp8, scale = quantize_fp8(weight.detach(), "channel")
        return cls(weight_fp8, scale, None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        from engine.kernels.triton_fp8 import (
            block_fp8_matmul,
            channel_fp8_matmul,
            per_token_group_quant_fp8,
            per_token_quant_fp8,
        )

        leading = x.shape[:-1]
        x = x.reshape(-1, self.in_features)  # [M, K]
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self.block_size is not None:
            x_fp8, x_scale = per_token_group_quant_fp8(x, self.block_size[1])  # [M, K], [M, ceil(K / bk)]
            out = block_fp8_matmul(x_fp8, x_scale, self.weight, self.weight_scale, self.block_size, x.dtype, self.bias)
            return out.reshape(*leading, self.out_features)
        if self._use_scaled_mm is None:
            self._use_scaled_mm = can_use_scaled_mm(x.device, x.dtype, self.in_features, self.out_features)
        x_fp8, x_scale = per_token_quant_fp8(x)  # [M, K], [M, 1]
        if self._use_scaled_mm:
            out = torch._scaled_mm(
                x_fp8,
                self.weight.t(),  # [K, N], column-major as cuBLASLt wants it
                scale_a=x_scale,
                scale_b=self.weight_scale.view(1, self.out_features),
                bias=self.bias,
                out_dtype=x.dtype,
            )
        else:
            out = channel_fp8_matmul(x_fp8, x_scale, self.weight, self.weight_scale, x.dtype, self.bias)
        return out.reshape(*leading, self.out_features)

    def extra_repr(self) -> str:
        scales = "per channel" if self.block_size is None else f"per block {self.block_size}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 {scales}"


def quantize_linear_layers(model: nn.Module, exclude: Collection[str] = ("lm_head",)) -> int:
    """Replace every nn.Linear under `model` whose weight is on CUDA (and whose name is
    not in `exclude`) by an Fp8Linear quantized per channel; returns how many.

    As pack_linear_layers does, only names are held while replacing, so each 16-bit
    weight is freed once its fp8 copy replaces it: memory peaks at the weights plus a few
    float32 copies of one layer (the quantization's temporaries)."""
    names = [
        name for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name not in exclude and module.weight.device.type == "cuda"
    ]
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, child_name)
        setattr(parent, child_name, Fp8Linear.quantize(child.weight, child.bias))
        del child
    return len(names)
