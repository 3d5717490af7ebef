"""Baton's engine: paged KV cache, iteration-level scheduler, Llama-family runner, sampler.

Heavy imports (torch, transformers) happen when these names are first used.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# Back torch's large CPU allocations (KV cache, weights) with transparent huge
# pages where the kernel allows it on request: decode steps stream the weights
# and hop between scattered KV blocks, and 2 MB pages cut their TLB misses
# (~3% end to end on the 2-core reference machine). torch reads the variable
# at its first large allocation; set THP_MEM_ALLOC_ENABLE=0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "CacheConfig", "SchedulerConfig"]

if TYPE_CHECKING:
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


def __getattr__(name: str):
    module_name = _LOCATIONS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
