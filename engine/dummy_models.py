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

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def eos_token_id(self) -> int:
        return self.config["eos_token_id"]


DUMMY_MODELS: dict[str, DummyModel] = {
    "llama-3.1-8b": DummyModel("llama", {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_parameters": _LLAMA3_ROPE, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128009,
    }),
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
    # Nothing real: a model that steps in milliseconds on a CPU, for benchmarks of the
    # serving system itself (benchmarks/chaos.py).
    "tiny": DummyModel("llama", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
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
