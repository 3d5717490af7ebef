"""The decoder's MLPs: a dense SwiGLU, and a mixture of SwiGLU experts behind a router.

`SparseMoE` follows transformers' Qwen3-MoE / Mixtral / Qwen2-MoE blocks op for op:
the router's logits in the model's dtype, softmax in float32, the top k, optionally
renormalized, then each token's experts summed with their routing weights. The
experts' weights are stacked, one parameter per projection per layer
(`gate_up_proj` [E, 2I, H], gate rows then up rows; `down_proj` [E, H, I]), so the
loader writes each checkpoint expert into its slice and the GPU kernel reads them
all as one tensor.

Three paths compute the same sum:
- CPU, float32, with the native kernels: one call per layer
  (engine/kernels/cpu_ops.cpp's moe_experts) on weights packed once at load into
  panels of 32 output columns (`SparseMoE.pack_experts`): the slots sorted by
  expert, each expert's tokens read in place, SiLU-and-mul in the gate/up tile's
  epilogue, the down projection's output times its routing weight added into its
  token's row in ascending expert order.
- CPU otherwise (float64, bfloat16, no native build): grouped in torch. The
  (token, slot) pairs are sorted by expert; each expert with tokens runs one matmul
  per projection over its gathered rows, and its outputs, times their routing
  weights, are added into their tokens' rows in ascending expert order.
  Both CPU paths add as transformers adds: exact against it up to the matmuls'
  summation order.
- CUDA: one fused-MoE Triton kernel per projection (engine/kernels/triton_moe.py):
  the pairs sorted into block-padded groups on the device, one grouped GEMM over all
  experts, the routing weights folded into the down projection's output. Nothing
  reads back to the host, so a MoE decode step captures in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch import ModelArch, MoEArch
from engine.model.ops import TORCH_OPS, ModelOps


def meta_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """An nn.Linear without storage (meta): the loader assigns the real weights."""
    return nn.Linear(in_features, out_features, bias=bias, device="meta")


def _meta_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = meta_linear(hidden_size, 2 * intermediate_size, bias)
        self.down_proj = meta_linear(intermediate_size, hidden_size, bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden), self.ops))


def silu_and_mul(gate_up: torch.Tensor, ops: ModelOps = TORCH_OPS) -> torch.Tensor:
    """[N, 2I] (gate, then up) -> silu(gate) * up [N, I]."""
    if ops.silu_and_mul is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Experts(nn.Module):
    """The stacked weights of a layer's experts (the loader assigns them)."""

    def __init__(self, moe: MoEArch, hidden_size: int) -> None:
        super().__init__()
        self.gate_up_proj = _meta_parameter(moe.num_experts, 2 * moe.intermediate_size, hidden_size)
        self.down_proj = _meta_parameter(moe.num_experts, hidden_size, moe.intermediate_size)
        # FP8 experts (CUDA): each weight's scales, per channel [E, N] or per block [E, N / bn, K / bk].
        self.register_buffer("gate_up_scale", None, persistent=False)
        self.register_buffer("down_scale", None, persistent=False)
        self.block_size: tuple[int, int] | None = None

    @property
    def packed(self) -> bool:
        """The weights are in the native CPU kernel's panels (SparseMoE.pack_experts):
        [E, panels, K, 32] rather than the stacked [E, N, K]."""
        return self.gate_up_proj.dim() == 4

    def quantize_fp8(self, block_size: tuple[int, int] | None) -> None:
        """Make the experts' weights FP8, per channel or per `block_size` block, one
        expert at a time (engine/model/quantization.py's quantize_model)."""
        from engine.model.fp8 import quantize_fp8

        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            pairs = [quantize_fp8(weight[e], "channel" if block_size is None else "block", block_size or (128, 128))
                     for e in range(weight.shape[0])]
            setattr(self, name, nn.Parameter(torch.stack([w for w, _ in pairs]), requires_grad=False))
            setattr(self, name.replace("_proj", "_scale"), torch.stack([s for _, s in pairs]))
            del weight, pairs
        self.block_size = block_size


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (see the module docstring), with Qwen2-MoE's gated
    shared expert where the architecture has one."""

    def __init__(self, arch: ModelArch, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        self.moe = moe
        self.ops = ops
        self.router = meta_linear(arch.hidden_size, moe.num_experts, False)
        self.experts = Experts(moe, arch.hidden_size)
        self.shared_expert: DenseMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = DenseMLP(arch.hidden_size, moe.shared_intermediate_size, ops=ops)
            self.shared_expert_gate = meta_linear(arch.hidden_size, 1, False)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [N, k] (int64) and their weights [N, k]."""
        logits = self.router(hidden)  # [N, E] in the model's dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.moe.float32_weights:
            weights = weights.to(hidden.dtype)
        return expert_ids, weights

    def pack_experts(self) -> bool:
        """Repack the experts' weights into the native CPU kernel's panels, where the ops
        have that kernel and the weights are float32 on CPU; returns whether it did. The
        unpacked weights are freed as the packed ones replace them."""
        experts = self.experts
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if (self.ops.pack_moe_weights is None or experts.packed or gate_up.device.type != "cpu"
                or gate_up.dtype != torch.float32 or down.dtype != torch.float32):
            return False
        packed_gate_up, packed_down = self.ops.pack_moe_weights(gate_up.detach(), down.detach())
        del gate_up, down
        experts.gate_up_proj = nn.Parameter(packed_gate_up, requires_grad=False)
        experts.down_proj = nn.Parameter(packed_down, requires_grad=False)
        return True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        expert_ids, weights = self.route(hidden)
        if hidden.is_cuda:
            from engine.kernels.triton_moe import fused_moe

            experts = self.experts
            out = fused_moe(hidden, experts.gate_up_proj, experts.down_proj, weights, expert_ids,
                            w13_scale=experts.gate_up_scale, w2_scale=experts.down_scale,
                            block_shape=experts.block_size)
        elif self.experts.packed:
            assert self.ops.moe_experts is not None
            out = self.ops.moe_experts(hidden.contiguous(), expert_ids, weights.contiguous(),
                                       self.experts.gate_up_proj, self.experts.down_proj, self.moe.intermediate_size)
        else:
            out = self.grouped(hidden, expert_ids, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out

    def grouped(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The torch CPU path: the slots sorted by expert and gathered once, one matmul per
        projection per expert that has tokens (each into its rows of one buffer), the
        activation and the routing weights over all slots at once, then every slot's
        output added into its token's row in sorted (ascending expert) order."""
        flat_ids = expert_ids.flatten()  # [N * k], slot s is token s // k
        order = torch.argsort(flat_ids, stable=True)  # the slots, grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.moe.num_experts).tolist()
        tokens = order // self.moe.top_k
        rows = hidden.index_select(0, tokens)  # [S, hidden], grouped by expert
        gate_up = _per_expert(rows, self.experts.gate_up_proj, counts)  # [S, 2I]
        down = _per_expert(silu_and_mul(gate_up, self.ops), self.experts.down_proj, counts)  # [S, hidden]
        down = down * weights.flatten().index_select(0, order)[:, None]  # float32 for Mixtral's weights
        return torch.zeros_like(hidden).index_add_(0, tokens, down.to(hidden.dtype))


def _per_expert(rows: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """rows [S, K] (grouped by expert, `counts` of each) times each group's expert's
    weight [E, N, K], transposed: [S, N], a torch.mm per expert that has rows."""
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for expert, count in enumerate(counts):
        if count:
            torch.mm(rows[start:start + count], weight[expert].t(), out=out[start:start + count])
            start += count
    return out
