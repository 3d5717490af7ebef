"""Tiny random Llama-family models built in code, and the transformers reference."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel


def tiny_configs_2026() -> dict[str, tuple[str, int, int, int, bool, dict]]:
    """Qwen3 and the mixtures of experts, as (architecture, heads, kv heads, head_dim,
    tied, extra config): each MoE with more experts than it routes to, so a short
    prompt leaves some experts without a token, and qwen3_moe with a dense layer among
    its sparse ones (mlp_only_layers)."""
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    return {
        "qwen3-gqa-hd32-qk-norm": ("qwen3", 4, 2, 32, True, {}),
        "qwen3-moe-norm-topk": ("qwen3_moe", 4, 2, 16, False, {**moe, "norm_topk_prob": True}),
        "qwen3-moe-no-norm-topk-dense-layer": (
            "qwen3_moe", 4, 2, 16, True, {**moe, "num_experts_per_tok": 3, "norm_topk_prob": False,
                                          "mlp_only_layers": [1]}),
        "mixtral-top2": ("mixtral", 4, 2, 16, False, {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                      "sliding_window": None}),
        "qwen2-moe-shared-expert": ("qwen2_moe", 4, 2, 16, True, {**moe, "shared_expert_intermediate_size": 48}),
    }


def make_tiny_model(
    directory: Path,
    arch: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    tied: bool = True,
    *,
    dtype: torch.dtype = torch.float64,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 160,
    seed: int = 0,
    **extra,
) -> tuple[PreTrainedModel, str]:
    """A random `arch` model saved to `directory`; returns it (eval, `dtype`) and the path."""
    extra.setdefault("intermediate_size", 2 * hidden_size)
    config = AutoConfig.for_model(
        arch,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )
    torch.manual_seed(seed)
    # transformers' eager experts loop is the reference (its grouped_mm has no float64).
    moe = {"experts_implementation": "eager"} if "expert" in str(config.to_dict()) else {}
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **moe).eval()
    # Random init is small; widen the weights so logits are not near-ties.
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)
    model.save_pretrained(directory)
    return model, str(directory)


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    """transformers' greedy generate for one unpadded prompt; EOS ignored unless stop_at_eos."""
    input_ids = torch.tensor([prompt])
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0 if eos is None else eos if isinstance(eos, int) else eos[0],
        temperature=None,
        top_p=None,
        top_k=None,
    )
    return out[0, len(prompt) :].tolist()
