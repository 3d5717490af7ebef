"""The decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, and the mixtures of experts
Qwen3-MoE, Mixtral and Qwen2-MoE: engine/model/arch.py) over a paged KV cache.

Numerically this follows transformers' eager modules op for op (RMSNorm in
float32, RoPE tables computed in float32 then cast), so float64 logits match
Hugging Face to ~1e-12. The only fusions are ones that leave each output
element's arithmetic unchanged (one q/k/v matmul, one gate/up matmul, RoPE on
q and k together), or that change only a reduction's order or an
intermediate rounding: the device's fused ops (engine/model/ops.py: native CPU
kernels, Triton on CUDA) for RoPE, SiLU-and-mul and RMSNorm with the residual
add before it, and, under the Triton attention backend, RoPE fused into the
KV-cache store.

Parameters are created on the meta device: the loader assigns every weight
(read from a checkpoint, or random for `dummy:` models) on the engine's device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionBatch
from engine.model.arch import ModelArch
from engine.model.mlp import DenseMLP, SparseMoE, meta_linear
from engine.model.ops import TORCH_OPS, ModelOps
from engine.model.packed_linear import PackedLinear, can_pack, pack_linear_layers


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype.

    Given the residual stream, it first adds `hidden` to it (in place, as
    transformers' `residual + hidden` does) and normalises the sum, in one fused
    pass where the device has the op.
    """

    def __init__(self, hidden_size: int, eps: float, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device="meta"))
        self.eps = eps
        self.ops = ops

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # float64 runs exist to match transformers exactly, and HF's float32
        # mean of squares can only be matched by the same torch reduction.
        fused = hidden.dtype != torch.float64
        if residual is not None:
            if fused and self.ops.add_rms_norm is not None:
                return self.ops.add_rms_norm(hidden, residual, self.weight, self.eps)
            hidden = residual.add_(hidden)
        if fused and self.ops.rms_norm is not None:
            return self.ops.rms_norm(hidden, self.weight, self.eps)
        input_dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.weight * hidden.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """transformers' rotary embedding as cos/sin tables for positions 0..max_positions-1.

    `inv_freq` and `attention_scaling` come from the HF model's rotary module,
    so every static rope type (default, linear, llama3, yarn, ...) is exact.
    Tables are computed in float32 and then cast, as HF does per forward.
    """

    def __init__(
        self,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq.to(device, torch.float32)[None, :]  # [P, Dh / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, Dh]
        self.register_buffer("cos", (emb.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention_scaling).to(dtype), persistent=False)

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [N], each [N, Dh]."""
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb on x [N, heads, Dh] (rotate-half convention); cos/sin [N, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, Dh], broadcast over heads
    return (x * cos) + (rotated * sin)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, backend: AttentionBackend, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        qkv_size = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
        self.qkv_proj = meta_linear(arch.hidden_size, qkv_size, arch.attention_bias)
        self.o_proj = meta_linear(arch.num_heads * arch.head_dim, arch.hidden_size, arch.o_proj_bias)
        self.scale = arch.head_dim**-0.5
        self.backend = backend
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, ops) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, ops) if arch.qk_norm else None

    @staticmethod
    def _norm_heads(norm: RMSNorm, heads: torch.Tensor) -> torch.Tensor:  # [N, heads, Dh]
        num_tokens, num_heads, head_dim = heads.shape
        return norm(heads.reshape(num_tokens * num_heads, head_dim)).view(num_tokens, num_heads, head_dim)

    def forward(
        self,
        hidden: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,  # [N, Dh]
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: object,
    ) -> torch.Tensor:  # [N, hidden]
        num_tokens = hidden.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per head, before RoPE
            qkv[:, :self.num_heads] = self._norm_heads(self.q_norm, qkv[:, :self.num_heads])
            qkv[:, self.num_heads:num_qk_heads] = self._norm_heads(self.k_norm, qkv[:, self.num_heads:num_qk_heads])
        if self.backend.fuses_rope:
            out = self.backend.forward_rotary(
                qkv, cos, sin, *kv_cache, attn_metadata, self.num_heads, self.scale
            )
            return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))
        if self.ops.rotary_embedding_ is not None:
            self.ops.rotary_embedding_(qkv, cos, sin, num_qk_heads)
            qk = qkv[:, :num_qk_heads]
        else:
            qk = apply_rotary(qkv[:, :num_qk_heads], cos, sin)  # [N, H + KvH, Dh]
        query, key = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        value = qkv[:, num_qk_heads:]  # [N, KvH, Dh]
        out = self.backend.forward(query, key, value, *kv_cache, attn_metadata, self.scale)
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    """One block. The residual stream is carried beside the hidden states, so each
    norm adds the sublayer's output to it in the same pass (`RMSNorm(x, residual)`)."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, ops: ModelOps = TORCH_OPS, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(arch, backend, ops)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp: nn.Module = (
            SparseMoE(arch, ops) if arch.is_sparse(layer)
            else DenseMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias, ops)
        )

    def forward(
        self, hidden, residual: torch.Tensor | None, cos, sin, kv_cache, attn_metadata
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (sublayer output, residual stream before it)
        if residual is None:  # the first layer: the embeddings are the residual stream
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, attn_metadata)
        hidden = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Decoder stack over a flattened, unpadded token batch and a paged KV cache.

    Parameters are created on the meta device; `engine.model.loader` assigns the
    weights (state-dict keys: `embed_tokens.weight`, `norm.weight`,
    `lm_head.weight` when untied, and per layer `layers.{i}.` +
    `input_layernorm.weight`, `self_attn.qkv_proj.{weight,bias}` (q, k, v rows
    concatenated), `self_attn.o_proj.*`, `post_attention_layernorm.weight`,
    `mlp.gate_up_proj.*` (gate rows then up rows), `mlp.down_proj.*`).
    """

    def __init__(
        self,
        arch: ModelArch,
        rotary: RotaryEmbedding,
        attention_backend: AttentionBackend,
        ops: ModelOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.attention_backend = attention_backend
        self.rotary = rotary
        self.ops = ops
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, device="meta")
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, attention_backend, ops, i) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.lm_head = (
            None if arch.tie_word_embeddings else meta_linear(arch.hidden_size, arch.vocab_size, False)
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, [num_blocks, block_size, KvH, Dh]
        attn_batch: AttentionBatch,
        attn_metadata: object,  # attention_backend.build_metadata(attn_batch, ...)
    ) -> torch.Tensor:  # [N, hidden], final norm applied
        """Run the decoder over N tokens, writing their K/V into `kv_caches` at attn_batch's slots."""
        assert input_ids.shape == positions.shape == (attn_batch.num_tokens,)
        assert len(kv_caches) == len(self.layers)
        cos, sin = self.rotary.lookup(positions)  # [N, Dh] each
        hidden = self.embed_tokens(input_ids)  # [N, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden, residual)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, hidden] -> [M, vocab]
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def pack_linear_weights(self) -> int:
        """Prepack matmul weights where the device and dtype allow: the linears for oneDNN
        (see packed_linear), a MoE's experts for the native CPU kernel (SparseMoE.pack_experts)."""
        replaced = pack_linear_layers(self)
        replaced += sum(module.pack_experts() for module in self.modules() if isinstance(module, SparseMoE))
        if self.lm_head is None and can_pack(self.embed_tokens.weight):
            # A packed copy of the tied embedding serves as the LM head.
            self.lm_head = PackedLinear(self.embed_tokens.weight, None)
            replaced += 1
        return replaced
