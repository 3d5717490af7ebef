"""Linear layers with weights prepacked for oneDNN, for CPU inference.

A plain fp32 `F.linear` re-lays out the weight in every call; oneDNN can keep
the weight in its blocked layout once, which makes the small-batch matmuls of
decode steps, and prefill steps, faster (the same op torch.compile's CPU backend
uses; docs/engine.md gives the measured gain).
float64 has no oneDNN kernel and keeps `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn

# Batch size the weight layout is tuned for; any batch size works.
PACK_BATCH_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        # oneDNN packs bfloat16 only on CPUs with bf16 instructions (AVX-512 or AVX-NE-CONVERT).
        and (weight.dtype != torch.bfloat16 or _cpu_has_bf16())
    )


def _cpu_has_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


class PackedLinear(nn.Module):
    """y = x W^T + b with W prepacked once; same results as nn.Linear up to summation order."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.register_buffer(
            "packed_weight",
            torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT),
            persistent=False,
        )
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every packable nn.Linear under `model` by a PackedLinear; returns how many.

    Only names are held while packing, so each unpacked weight is freed once its packed
    copy replaces it (when nothing else holds it): memory peaks at the weights plus one
    layer, not twice the weights."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    replaced = 0
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, child_name)
        if can_pack(child.weight):
            setattr(parent, child_name, PackedLinear(child.weight, child.bias))
            replaced += 1
        del child
    return replaced
