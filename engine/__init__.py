"""Baton's engine: paged KV cache, iteration-level scheduler, Llama-family runner, sampler.

Importing `engine` does no work (no environment variable, no thread count: the
entry points set those up, see engine/envs.py), and the names below are imported
from their modules when first used, so a process that needs only a light part
(the gateway's tokenizer, the wire records) never loads the model, attention or
kernel modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_attributes

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "CacheConfig", "SchedulerConfig"]

if TYPE_CHECKING:  # for type checkers only: never run
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

_LOCATIONS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.engine",
    "SamplingParams": "engine.sampling_params",
    "EngineConfig": "engine.config",
    "CacheConfig": "engine.config",
    "SchedulerConfig": "engine.config",
}


__getattr__ = lazy_attributes(__name__, _LOCATIONS)
