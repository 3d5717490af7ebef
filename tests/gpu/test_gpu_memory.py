"""Sizing the KV cache on a GPU (engine/runner/memory.py), on made-up device memory readings:
`gpu_memory_utilization` is this process's share of the device, memory other processes
hold does not shrink it but must leave it free, and the decode graphs' reserve comes out
of it."""

from __future__ import annotations

import pytest

from engine.runner.memory import (CAPTURE_WORKSPACE_BYTES, DeviceMemory, GraphReserve, MemoryProfile,
                                  check_share_is_free, kv_cache_budget)

GiB = 2**30
TOTAL = 80 * GiB
BLOCK = 2 << 20  # Llama-3.1-8B: 16 tokens x 128 KiB


def reading(free: float, reserved: float = 0.0) -> DeviceMemory:
    return DeviceMemory(TOTAL, int(free * GiB), int(reserved * GiB))


def profile(start: DeviceMemory, end: DeviceMemory, peak: float, graphs: float = 0.0) -> MemoryProfile:
    return MemoryProfile(start, end, int(peak * GiB), int(graphs * GiB))


def test_memory_other_processes_hold_does_not_shrink_the_share():
    # Another process (a test runner's leftovers, a worker beside us) holds 21 GiB.
    start = reading(free=80 - 21 - 0.5)
    check_share_is_free(start, 0.34, "cuda:0")
    # After loading and profiling: 16 GiB of weights + 2 GiB of activations were our peak,
    # the allocator gave the activations back, our own outside-torch memory grew by 0.25 GiB.
    end = reading(free=80 - 21 - 0.5 - 16 - 0.25, reserved=16)
    budget = kv_cache_budget(profile(start, end, peak=18), 0.34, BLOCK)
    assert budget == int(0.34 * TOTAL) - 18 * GiB - GiB // 4
    # The old reading counted the other process's 21 GiB against the share: no cache at all.
    assert int(0.34 * TOTAL) - 18 * GiB - 21 * GiB < 0


def test_a_share_that_is_not_free_is_refused_before_loading():
    start = reading(free=80 - 21 - 0.5)
    with pytest.raises(ValueError, match=r"58\.5 GiB free of 80\.0 GiB.*0\.9 asks for.*72\.0 GiB.*21\.5 GiB are "
                                         r"held by other processes"):
        check_share_is_free(start, 0.9, "cuda:0")


def test_what_this_process_holds_already_counts_inside_its_share():
    # A benchmark holding a transformers model of 16 GiB before it starts Baton's engine:
    # that memory is inside the share, so the share needs only the rest free.
    start = reading(free=80 - 16 - 0.5, reserved=16)
    check_share_is_free(start, 0.85, "cuda:0")
    end = reading(free=80 - 16 - 0.5 - 16, reserved=32)
    # The peak counts every tensor of the process: both models, so the cache shrinks by both.
    budget = kv_cache_budget(profile(start, end, peak=34), 0.85, BLOCK)
    assert budget == int(0.85 * TOTAL) - 34 * GiB


def test_the_decode_graphs_reserve_comes_out_of_the_cache():
    start, end = reading(free=79.5), reading(free=79.5 - 16, reserved=16)
    without = kv_cache_budget(profile(start, end, peak=18), 0.9, BLOCK)
    with_graphs = kv_cache_budget(profile(start, end, peak=18, graphs=0.75), 0.9, BLOCK)
    assert without - with_graphs == int(0.75 * GiB)
    reserve = GraphReserve(batch_size=256, persistent_bytes=40 << 20)
    assert reserve.total_bytes(100 << 20) == (140 << 20) + CAPTURE_WORKSPACE_BYTES


def test_memory_others_free_meanwhile_is_not_ours():
    # Another process gave back 10 GiB while we profiled: outside-torch memory shrank.
    start, end = reading(free=50), reading(free=50 + 10 - 16, reserved=16)
    assert kv_cache_budget(profile(start, end, peak=18), 0.5, BLOCK) == int(0.5 * TOTAL) - 18 * GiB


def test_no_block_left_names_what_took_the_share():
    start, end = reading(free=79.5), reading(free=79.5 - 16, reserved=16)
    with pytest.raises(ValueError, match=r"no GPU memory is left for the KV cache.*the model and its largest "
                                         r"step take 18\.0 GiB.*CUDA graphs 0\.8 GiB"):
        kv_cache_budget(profile(start, end, peak=18, graphs=0.8), 0.2, BLOCK)


def test_the_profiling_forward_measures_the_step_and_the_largest_decode_batch(tmp_path, monkeypatch):
    """profile_memory itself, on CPU tensors with torch.cuda's memory counters faked: the
    largest step and the largest padded decode batch run through the real model, and the
    figures land where kv_cache_budget reads them."""
    import torch

    from engine import LLM
    from engine.runner.memory import profile_memory
    from tests.support.tiny_models import make_tiny_model

    _, model_dir = make_tiny_model(tmp_path, dtype=torch.float32)
    engine = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=64, max_num_seqs=8,
                 num_kv_blocks=64).engine
    forwards = []
    model = engine.runner.model
    monkeypatch.setattr(model, "forward", lambda ids, *args, **kwargs: forwards.append(len(ids)) or
                        type(model).forward(model, ids, *args, **kwargs))
    for name in ("empty_cache", "synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 300 << 20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 200 << 20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 320 << 20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GiB, TOTAL))
    start = reading(free=79.5)
    profile = profile_memory(model, engine.kv_layout, engine.config, engine.max_model_len, torch.device("cpu"), start,
                             GraphReserve(batch_size=8, persistent_bytes=4096))
    assert forwards == [64, 8]  # the token budget's step, then 8 one-token decodes
    step_cache = 8 * engine.kv_layout.bytes_per_block  # blocks for 64 tokens of 16, or 8 decodes
    assert profile.peak_allocated_bytes == (300 << 20) - step_cache
    # The decode batch's segments (reserved, as the graphs' pool is counted), the graphs'
    # inputs and outputs, a capture stream's workspaces.
    assert profile.graph_reserve_bytes == (120 << 20) + 4096 + CAPTURE_WORKSPACE_BYTES
    assert profile.start == start and profile.end == DeviceMemory(TOTAL, 60 * GiB, 200 << 20)
