"""What our decoder needs to know of a model, read from its Hugging Face config, and
the names and shapes of its parameters.

One decoder (engine/model/llama.py) serves every architecture here: they differ only
in options of the same block.

    model_type   attention                          MLP
    llama        q/k/v (bias optional)              dense SwiGLU
    mistral      q/k/v                              dense SwiGLU
    qwen2        q/k/v with bias                    dense SwiGLU
    qwen3        q/k/v, RMSNorm per head on q, k    dense SwiGLU
    qwen3_moe    as qwen3                           routed experts (softmax, top-k, norm_topk_prob)
    mixtral      q/k/v                              routed experts (top-k renormalized)
    qwen2_moe    q/k/v with bias                    routed experts + a shared expert behind a sigmoid gate

`ModelArch.from_hf_config` refuses (ValueError, one line) whatever the decoder would
not compute exactly as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class MoEArch:
    """A mixture-of-experts MLP: `num_experts` SwiGLU experts of width
    `intermediate_size`, `top_k` of them per token, chosen by a linear router.

    Routing is transformers': softmax over the router's logits in float32, the top k,
    renormalized to sum to 1 where `norm_topk_prob`; the weights are cast to the
    model's dtype unless `float32_weights` (Mixtral multiplies in float32). A shared
    expert (width `shared_intermediate_size`, 0 = none) runs on every token, its
    output scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE). Layers not in
    `sparse_layers` keep a dense MLP of the config's `intermediate_size`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_intermediate_size: int = 0
    float32_weights: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be within 1..num_experts {self.num_experts}")

    @classmethod
    def from_hf_config(cls, config: Any) -> MoEArch:
        model_type = config.model_type
        num_layers = config.num_hidden_layers
        if model_type == "mixtral":
            return cls(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                       intermediate_size=config.intermediate_size, norm_topk_prob=True,
                       sparse_layers=tuple(range(num_layers)), float32_weights=True)
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        shared = getattr(config, "shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        return cls(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                   intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                   sparse_layers=sparse, shared_intermediate_size=shared or 0)


@dataclass(frozen=True)
class ModelArch:
    """Shape and options of a decoder model, read from its Hugging Face config."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's (every layer's, without experts)
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias
    o_proj_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    sliding_window: int | None = None  # Mistral's window; attention here is always full
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    moe: MoEArch | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(unsupported_message(self.model_type))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        """Read a transformers config; ValueError for anything this model cannot run exactly."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(unsupported_message(model_type))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only silu")
        if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and getattr(config, "use_sliding_window", False):
            raise ValueError(f"{model_type} with use_sliding_window=True is not supported")
        rope_parameters = getattr(config, "rope_parameters", None) or {}
        rope_type = rope_parameters.get("rope_type", "default")
        if rope_type in _DYNAMIC_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} changes with sequence length; not supported")

        num_heads = config.num_attention_heads
        if model_type in ("qwen2", "qwen2_moe"):  # q/k/v biased, o not
            qkv_bias, o_bias = bool(getattr(config, "qkv_bias", True)), False
        elif model_type in ("llama", "qwen3", "qwen3_moe"):
            qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
        else:
            qkv_bias = o_bias = False
        return cls(
            model_type=model_type,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=model_type == "llama" and bool(getattr(config, "mlp_bias", False)),
            max_position_embeddings=config.max_position_embeddings,
            sliding_window=getattr(config, "sliding_window", None) if model_type in ("mistral", "mixtral") else None,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=MoEArch.from_hf_config(config) if model_type in MOE_MODEL_TYPES else None,
        )


def unsupported_message(model_type: object) -> str:
    return (
        f"unsupported model_type {model_type!r}; supported architectures: "
        + ", ".join(SUPPORTED_MODEL_TYPES)
    )


def parameter_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Our parameter names (see LlamaForCausalLM) and their shapes."""
    hidden, inter, head_dim = arch.hidden_size, arch.intermediate_size, arch.head_dim
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (arch.vocab_size, hidden),
        "norm.weight": (hidden,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, hidden)
    for i in range(arch.num_layers):
        prefix = f"layers.{i}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        shapes[prefix + "self_attn.qkv_proj.weight"] = (qkv_rows, hidden)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, arch.num_heads * head_dim)
        if arch.attention_bias:
            shapes[prefix + "self_attn.qkv_proj.bias"] = (qkv_rows,)
        if arch.o_proj_bias:
            shapes[prefix + "self_attn.o_proj.bias"] = (hidden,)
        if arch.qk_norm:
            shapes[prefix + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[prefix + "self_attn.k_norm.weight"] = (head_dim,)
        if arch.is_sparse(i):
            moe = arch.moe
            assert moe is not None
            shapes[prefix + "mlp.router.weight"] = (moe.num_experts, hidden)
            shapes[prefix + "mlp.experts.gate_up_proj"] = (moe.num_experts, 2 * moe.intermediate_size, hidden)
            shapes[prefix + "mlp.experts.down_proj"] = (moe.num_experts, hidden, moe.intermediate_size)
            if moe.shared_intermediate_size:
                shared = moe.shared_intermediate_size
                shapes[prefix + "mlp.shared_expert.gate_up_proj.weight"] = (2 * shared, hidden)
                shapes[prefix + "mlp.shared_expert.down_proj.weight"] = (hidden, shared)
                shapes[prefix + "mlp.shared_expert_gate.weight"] = (1, hidden)
            continue
        shapes[prefix + "mlp.gate_up_proj.weight"] = (2 * inter, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, inter)
        if arch.mlp_bias:
            shapes[prefix + "mlp.gate_up_proj.bias"] = (2 * inter,)
            shapes[prefix + "mlp.down_proj.bias"] = (hidden,)
    return shapes
