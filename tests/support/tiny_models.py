"""Tiny random Llama-family models built in code, and the transformers reference."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel


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
    config = AutoConfig.for_model(
        arch,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
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
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
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
