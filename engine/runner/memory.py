"""Sizing the KV cache on a GPU: what is left of this process's share of the device's
memory once the weights are loaded, the largest step has run, and room is kept for the
CUDA graphs of decode steps.

    total memory x gpu_memory_utilization        this process's share (it must be free at start)
    ├── peak of this process's torch allocations during a profiling forward: weights, and
    │   the activations and logits of a step at the full token budget
    ├── memory outside torch that appeared meanwhile (cuBLAS handles, kernel modules)
    ├── the decode graphs' reserve: their pool (the activations of the largest padded
    │   decode batch and every graph's output), their persistent inputs, and a capture
    │   stream's cuBLAS workspaces
    └── the KV cache  <- what this returns

`gpu_memory_utilization` is this process's share of the device, as in vLLM v1: memory
other processes hold (another worker on the same GPU, a test runner's leftovers) does
not shrink the cache, but the share must be free when the engine starts (less what this
process's torch already holds, which counts inside the share), or it refuses to start,
saying what is free and who holds the rest. Two workers on one GPU each take their own
share (`baton up --device cuda` gives the prefill worker `--prefill-memory-fraction` of
`--gpu-memory-utilization` and the decode worker the rest).

The profiling forward runs the real model over `max_num_batched_tokens` tokens (one
sequence per `max_model_len` tokens, the budget's split across `max_num_seqs` sampled
rows for the logits) against a cache just large enough for it, which is freed before
the real cache is made. The arithmetic is `kv_cache_budget`, a pure function of
`DeviceMemory` readings, so tests check it with made-up ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention.base import SequenceSpan, build_attention_batch
from engine.config import EngineConfig
from engine.kv.cache import KVCache, KVLayout
from engine.kv.manager import cdiv

logger = logging.getLogger(__name__)

GiB = 2**30
# A capture stream's cuBLAS and cuBLASLt workspaces (graphs are captured on a stream of
# their own, and cuBLAS keeps a workspace per stream): a few tens of MiB on Hopper.
CAPTURE_WORKSPACE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One reading of a GPU's memory: the driver's free and total, this process's torch."""

    total_bytes: int
    free_bytes: int
    torch_reserved_bytes: int  # held by this process's caching allocator (used or cached)

    @property
    def outside_torch_bytes(self) -> int:
        """Memory in use that this process's torch does not hold: other processes, and this
        process's CUDA context and libraries."""
        return self.total_bytes - self.free_bytes - self.torch_reserved_bytes


def read_device_memory(device: torch.device) -> DeviceMemory:
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free, torch.cuda.memory_reserved(device))


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What one engine's profiling measured, for `kv_cache_budget`."""

    start: DeviceMemory  # before the engine loaded anything
    end: DeviceMemory  # after the profiling forward, its memory given back
    peak_allocated_bytes: int  # this process's torch peak during the profiling forward (weights
    # included, and whatever else the process holds), its scratch cache excluded
    graph_reserve_bytes: int  # what the decode graphs will take once captured (0: no graphs)


def check_share_is_free(start: DeviceMemory, gpu_memory_utilization: float, device: torch.device) -> None:
    """ValueError, before anything is loaded, when this process's share of the device is not
    free (what its torch holds already counts inside the share)."""
    requested = int(start.total_bytes * gpu_memory_utilization)
    if start.free_bytes + start.torch_reserved_bytes < requested:
        raise ValueError(
            f"{device} has {start.free_bytes / GiB:.1f} GiB free of {start.total_bytes / GiB:.1f} GiB, less than "
            f"gpu_memory_utilization {gpu_memory_utilization} asks for this engine ({requested / GiB:.1f} GiB): "
            f"{start.outside_torch_bytes / GiB:.1f} GiB are held by other processes (nvidia-smi lists them) and "
            f"{start.torch_reserved_bytes / GiB:.1f} GiB by this process; lower "
            "gpu_memory_utilization or free the GPU"
        )


def kv_cache_budget(profile: MemoryProfile, gpu_memory_utilization: float, bytes_per_block: int) -> int:
    """The KV cache's bytes: this process's share less what its tensors at the largest step
    (the model's weights among them), the memory outside torch it added and its decode graphs
    take. ValueError if not even one block is left."""
    start, end = profile.start, profile.end
    requested = int(start.total_bytes * gpu_memory_utilization)
    model_and_step = profile.peak_allocated_bytes
    # Another process's growth meanwhile would be counted too: a start-up race, on the safe side.
    added_outside_torch = max(0, end.outside_torch_bytes - start.outside_torch_bytes)
    budget = requested - model_and_step - added_outside_torch - profile.graph_reserve_bytes
    logger.info("GPU memory: %.1f GiB total, this process's share %.1f GiB (gpu_memory_utilization %.2f): "
                "%.2f GiB for the model and its largest step, %.2f GiB added outside torch, %.2f GiB kept for "
                "CUDA graphs, %.2f GiB for the KV cache", start.total_bytes / GiB, requested / GiB,
                gpu_memory_utilization, model_and_step / GiB, added_outside_torch / GiB,
                profile.graph_reserve_bytes / GiB, budget / GiB)
    if budget < bytes_per_block:
        raise ValueError(
            f"no GPU memory is left for the KV cache: of this process's {requested / GiB:.1f} GiB "
            f"(gpu_memory_utilization {gpu_memory_utilization} of {start.total_bytes / GiB:.1f} GiB), the model "
            f"and its largest step take {model_and_step / GiB:.1f} GiB, memory outside torch "
            f"{added_outside_torch / GiB:.1f} GiB and CUDA graphs {profile.graph_reserve_bytes / GiB:.1f} GiB; "
            "raise gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or size the cache "
            "with kv_cache_memory_bytes / num_kv_blocks"
        )
    return budget


@torch.inference_mode()
def profile_memory(model: torch.nn.Module, layout: KVLayout, config: EngineConfig, max_model_len: int,
                   device: torch.device, start: DeviceMemory, graph_reserve: GraphReserve | None) -> MemoryProfile:
    """Run the largest step once (and, with decode graphs, the largest padded decode batch)
    and return what it measured."""
    num_tokens = min(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs * max_model_len)
    lengths = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lengths.append(num_tokens % max_model_len)
    block_size = layout.block_size
    num_blocks = sum(cdiv(n, block_size) for n in lengths)
    if graph_reserve is not None:
        num_blocks = max(num_blocks, graph_reserve.batch_size)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cache = KVCache(layout, num_blocks, 0, device)
    cache_bytes = cache.blocks.numel() * cache.blocks.element_size()
    spans, next_block = [], 0
    for length in lengths:
        blocks = list(range(next_block, next_block + cdiv(length, block_size)))
        spans.append(SequenceSpan(blocks, 0, length))
        next_block += len(blocks)
    hidden = _forward(model, cache, layout, [], spans, device)
    num_rows = min(config.scheduler.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:num_rows]).float()
    # The sampler's worst case holds a few float32 copies of the logits.
    logits.softmax(dim=-1).sort(dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - cache_bytes
    del hidden, logits
    graph_bytes = 0
    if graph_reserve is not None:
        # The graphs' pool holds what the largest padded decode batch allocates while it runs,
        # in the allocator's segments: counted as reserved, as the capture's memory is.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_reserved(device)
        decodes = [SequenceSpan([i], 0, 1) for i in range(graph_reserve.batch_size)]
        _forward(model, cache, layout, decodes, [], device)
        torch.cuda.synchronize(device)
        graph_bytes = graph_reserve.total_bytes(torch.cuda.max_memory_reserved(device) - before)
    del cache
    torch.cuda.empty_cache()
    return MemoryProfile(start, read_device_memory(device), peak, graph_bytes)


@dataclass(frozen=True, slots=True)
class GraphReserve:
    """The decode graphs' memory besides their activations (engine/runner/decode_graphs.py)."""

    batch_size: int  # the largest padded batch: its activations size the pool
    persistent_bytes: int  # the graphs' inputs and their outputs, which live as long as the graphs

    def total_bytes(self, activation_bytes: int) -> int:
        return activation_bytes + self.persistent_bytes + CAPTURE_WORKSPACE_BYTES


def _forward(model, cache: KVCache, layout: KVLayout, decodes: list[SequenceSpan], prefills: list[SequenceSpan],
             device: torch.device) -> torch.Tensor:
    batch = build_attention_batch(decodes, prefills, layout.block_size, device)
    backend = model.attention_backend
    metadata = backend.build_metadata(batch, layout.block_size, model.arch.num_heads, layout.num_kv_heads,
                                      layout.head_dim, layout.dtype)
    spans = [*decodes, *prefills]
    input_ids = torch.zeros(sum(s.num_new_tokens for s in spans), dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(s.num_cached_tokens, s.num_cached_tokens + s.num_new_tokens, device=device)
                           for s in spans])
    return model(input_ids, positions, cache.layers, batch, metadata)
