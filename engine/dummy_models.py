"""Models with random weights at real shapes: `dummy:<name>`, for measuring where no
checkpoint can be downloaded (vLLM's `--load-format dummy`).

Each entry is the architecture of a published model, written out here as the
keyword arguments of its transformers config. The weights are random
(engine/model/dummy.py fills them on the device), and the tokenizer is a
byte-level one of the model's vocabulary size (engine/tokenizer.py), so text
goes in and (meaningless) text comes out: the whole serving path runs.

Pure data: the gateway reads the vocabulary size and EOS id from here without
importing torch or any model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DUMMY_PREFIX = "dummy:"

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


@dataclass(frozen=True)
class DummyModel:
    """One architecture: its transformers model_type and config keywords."""

    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    # The quantization_config of the model's FP8 release (engine/model/quantization.py):
    # the random weights are made FP8 in its layout at load.
    quantization: dict[str, Any] | None = None

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def eos_token_id(self) -> int:
        return self.config["eos_token_id"]


_LLAMA_3_1_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_parameters": _LLAMA3_ROPE, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128009,
}
_QWEN3 = {
    "num_attention_heads": 32, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False, "use_sliding_window": False, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
_QWEN3_8B = {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
             "num_key_value_heads": 8}
_QWEN3_30B_A3B = {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                  "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": []}

DUMMY_MODELS: dict[str, DummyModel] = {
    "llama-3.1-8b": DummyModel("llama", _LLAMA_3_1_8B),
    "llama-3.2-1b": DummyModel("llama", {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 32.0}, "tie_word_embeddings": True,
        "bos_token_id": 128000, "eos_token_id": 128009,
    }),
    "qwen2.5-7b": DummyModel("qwen2", {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 152064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    }),
    "smollm2-135m": DummyModel("llama", {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }),
    "qwen3-8b": DummyModel("qwen3", _QWEN3_8B),
    "qwen3-30b-a3b": DummyModel("qwen3_moe", _QWEN3_30B_A3B),
    "mixtral-8x7b": DummyModel("mixtral", {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "sliding_window": None,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }),
    # FP8 releases: per-channel weights with dynamic activations (the -FP8-dynamic
    # compressed-tensors release of Llama 3.1 8B), and Qwen's own 128x128 blocks.
    "llama-3.1-8b-fp8": DummyModel("llama", _LLAMA_3_1_8B, quantization={
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                  "symmetric": True}}}}),
    "qwen3-30b-a3b-fp8": DummyModel("qwen3_moe", _QWEN3_30B_A3B, quantization={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
    # Nothing real: a model that steps in milliseconds on a CPU, for benchmarks of the
    # serving system itself (benchmarks/chaos.py).
    "tiny": DummyModel("llama", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }),
    # tiny's mixture of experts (Qwen3-MoE's block): 8 experts, 2 a token, for the CPU run
    # of benchmarks/gpu_models.py.
    "tiny-moe": DummyModel("qwen3_moe", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "attention_bias": False,
        "use_sliding_window": False, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }),
}


def dummy_model(model: str) -> DummyModel | None:
    """The entry `model` names ("dummy:<name>"), None for any other model string;
    ValueError for an unknown name."""
    if not model.startswith(DUMMY_PREFIX):
        return None
    name = model.removeprefix(DUMMY_PREFIX)
    try:
        return DUMMY_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown dummy model {name!r}; available: {', '.join(sorted(DUMMY_MODELS))}"
        ) from None
