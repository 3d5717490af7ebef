"""Llama-family model over a paged KV cache, and its loader (transformers imported on demand)."""

from engine.model.arch import SUPPORTED_MODEL_TYPES, ModelArch
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import LoadedModel, load_from_hf_model, load_model

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelArch",
    "load_from_hf_model",
    "load_model",
]
