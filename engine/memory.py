"""Sizing the KV cache on a GPU: what is left of `gpu_memory_utilization` of the
device's memory once the weights are loaded and the largest step has run.

    total memory x gpu_memory_utilization
    ├── memory not allocated by this process's torch (CUDA context, other processes)
    ├── peak of torch's allocations during a profiling forward: weights, and the
    │   activations and logits of a step at the full token budget
    └── the KV cache  <- what this returns

The profiling forward runs the real model over `max_num_batched_tokens` tokens
(one sequence per `max_model_len` tokens, the budget's split across
`max_num_seqs` sampled rows for the logits) against a cache just large enough
for it, which is freed before the real cache is made. As in vLLM, memory other
processes hold on the same GPU counts against the fraction.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.base import SequenceSpan, build_attention_batch
from engine.block_pool import cdiv
from engine.config import EngineConfig
from engine.kv_cache import KVCache, KVLayout

logger = logging.getLogger(__name__)


@torch.inference_mode()
def profile_kv_cache_budget(model: torch.nn.Module, layout: KVLayout, config: EngineConfig, max_model_len: int,
                            device: torch.device) -> int:
    """Run the largest step once and return the KV cache's budget in bytes (ValueError if none)."""
    num_tokens = min(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs * max_model_len)
    lengths = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lengths.append(num_tokens % max_model_len)
    block_size = layout.block_size
    num_blocks = sum(cdiv(n, block_size) for n in lengths)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cache = KVCache(layout, num_blocks, 0, device)
    spans, next_block = [], 0
    for length in lengths:
        blocks = list(range(next_block, next_block + cdiv(length, block_size)))
        spans.append(SequenceSpan(blocks, 0, length))
        next_block += len(blocks)
    batch = build_attention_batch([], spans, block_size, device)
    backend = model.attention_backend
    metadata = backend.build_metadata(batch, block_size, model.arch.num_heads, layout.num_kv_heads,
                                      layout.head_dim, layout.dtype)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    hidden = model(input_ids, positions, cache.layers, batch, metadata)
    num_rows = min(config.scheduler.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:num_rows]).float()
    # The sampler's worst case holds a few float32 copies of the logits.
    logits.softmax(dim=-1).sort(dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - cache.blocks.numel() * cache.blocks.element_size()
    del cache, hidden, logits, metadata, batch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * config.cache.gpu_memory_utilization) - peak - non_torch
    logger.info("GPU memory: %.1f GiB total, %.1f GiB outside torch, %.1f GiB peak of the model's step, "
                "%.1f GiB for the KV cache (gpu_memory_utilization %.2f)", total / 2**30, non_torch / 2**30,
                peak / 2**30, budget / 2**30, config.cache.gpu_memory_utilization)
    if budget < layout.bytes_per_block:
        raise ValueError(
            f"no GPU memory is left for the KV cache: {peak / 2**30:.1f} GiB peak for the model's largest "
            f"step and {non_torch / 2**30:.1f} GiB used outside it, of {total / 2**30:.1f} GiB x "
            f"gpu_memory_utilization {config.cache.gpu_memory_utilization}; raise gpu_memory_utilization, "
            "lower max_num_batched_tokens, or size the cache with kv_cache_memory_bytes / num_kv_blocks"
        )
    return budget

