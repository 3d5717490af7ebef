"""The fused elementwise ops a model runs, chosen by the device it runs on.

    device   ops                 RMSNorm (+ residual add)   RoPE            SiLU-and-mul
    cpu      native, if built    engine/kernels/cpu_ops     cpu_ops         cpu_ops
    cpu      torch otherwise     torch                      torch           torch
             (and for float16)
    cuda     triton              engine/kernels/triton_ops  torch (*)       triton_ops

(*) On CUDA the Triton attention backend rotates q and k inside its fused
RoPE + KV-store kernel, so the model's own RoPE op only runs under other
backends. A `None` op means the plain torch formula, which follows
transformers op for op (and is the only path exact in float64).

A MoE layer's experts run in one native call on CPU in float32 (cpu_ops'
moe_experts, weights packed at load), in torch otherwise on CPU, and in the
fused-MoE Triton kernel on CUDA (engine/model/mlp.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelOps:
    """Fused replacements of the model's elementwise code; None = the torch formula."""

    name: str
    # (hidden [N, D], weight [D], eps) -> [N, D]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    # (x [N, D], residual [N, D] updated in place to x + residual, weight, eps) -> norm of the sum
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    # (qkv [N, heads, Dh] rotated in place on heads [0, n), cos [N, Dh], sin [N, Dh], n) -> None
    rotary_embedding_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None] | None = None
    # gate_up [N, 2I] -> silu(gate) * up [N, I]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    # A MoE layer's experts in one call, on weights packed once at load:
    # pack_moe_weights(gate_up [E, 2I, H], down [E, H, I]) -> (packed gate_up, packed down);
    # moe_experts(hidden [N, H], expert_ids [N, k], weights [N, k], packed gate_up, packed down,
    # I) -> [N, H]. None = the grouped torch path (a torch.mm per expert with tokens).
    pack_moe_weights: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    moe_experts: Callable[..., torch.Tensor] | None = None


TORCH_OPS = ModelOps("torch")


def select_ops(device: torch.device | str, dtype: torch.dtype = torch.float32) -> ModelOps:
    """The fused ops for `device`: native kernels on CPU (when they build, and for the
    dtypes they have: float32, bfloat16, float64), Triton on CUDA."""
    device_type = torch.device(device).type
    if device_type == "cuda":
        from engine.kernels import triton_ops

        return ModelOps("triton", rms_norm=triton_ops.rms_norm, add_rms_norm=triton_ops.add_rms_norm,
                        silu_and_mul=triton_ops.silu_and_mul)
    from engine import kernels

    if dtype in kernels.CPU_KERNEL_DTYPES and kernels.cpu_kernels_available():
        return ModelOps(
            "cpu",
            rms_norm=kernels.rms_norm,
            rotary_embedding_=kernels.rotary_embedding_,
            silu_and_mul=kernels.silu_and_mul,
            # float32 only: float64 runs are for exactness against transformers' own matmuls.
            pack_moe_weights=kernels.pack_moe_weights if dtype == torch.float32 else None,
            moe_experts=kernels.moe_experts if dtype == torch.float32 else None,
        )
    return TORCH_OPS
