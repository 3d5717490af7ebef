"""How much each section of benchmarks/gpu.py measures: FULL (the default), QUICK
(--quick), CHECK (--check: `make gpu-check`'s figures, a few minutes of one GPU) and TINY
(--tiny, the CPU smoke run)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from benchmarks.gpu_offline import LogNormalWorkloadConfig
from benchmarks.workload import WorkloadConfig


@dataclass(frozen=True)
class BenchSizes:
    """How much each section measures: FULL, QUICK (--quick), CHECK (--check) or TINY (--tiny: the CPU smoke)."""

    copy_bytes: int
    copy_iters: int
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_steps: int
    decode_warmup_steps: int
    decode_max_num_batched_tokens: int  # the decode engine's step budget (prefill chunks)
    roofline_points: tuple[tuple[int, int], ...]  # (batch, context)
    roofline_target: tuple[int, int]  # the point the roofline target is judged at
    attention_shapes: tuple[tuple[int, int], ...]  # (batch, context)
    attention_iters: int
    latency_batches: tuple[int, ...]  # steady decode in every graphs/overlap mode: the first and last are judged
    latency_context: int
    sharegpt: LogNormalWorkloadConfig
    mixed: WorkloadConfig
    static_batch_size: int
    num_warmup_requests: int


FULL = BenchSizes(
    copy_bytes=4 << 30, copy_iters=20,
    decode_batches=(1, 8, 64, 256), decode_context=1024, decode_steps=32, decode_warmup_steps=4,
    decode_max_num_batched_tokens=8192,
    roofline_points=tuple((b, c) for c in (512, 1024, 4096) for b in (1, 16, 64, 256)),
    roofline_target=(256, 1024),
    attention_shapes=((64, 1024), (16, 4096), (256, 256), (4, 16384)), attention_iters=50,
    latency_batches=(1, 64), latency_context=512,
    sharegpt=LogNormalWorkloadConfig(num_requests=1000),
    mixed=WorkloadConfig(num_requests=512),
    static_batch_size=64, num_warmup_requests=32,
)
QUICK = replace(
    FULL, copy_bytes=2 << 30, copy_iters=10, decode_steps=16,
    roofline_points=((1, 512), (16, 512), (64, 512), (256, 512), (1, 1024), (16, 1024), (64, 1024), (256, 1024),
                     (1, 4096), (16, 4096)),
    attention_iters=20,
    sharegpt=LogNormalWorkloadConfig(num_requests=256), mixed=WorkloadConfig(num_requests=256),
)
# The figures `make gpu-check` judges, in as little GPU time as they can be had: batch 1 and
# 64 only (11 batch sizes, 16 graphs to capture on 132 SMs), and the full mixed workload
# (eight static batches: at two, continuous batching cannot reach 2x static; H200, 2026-11-26:
# 1.55x at 128 requests, 2.43x at 512), which the check runs on Baton only.
CHECK = replace(
    QUICK, copy_bytes=1 << 30, decode_batches=(1, 64), decode_context=512,
    roofline_points=((1, 512), (64, 512)), roofline_target=(64, 512),
    attention_shapes=((64, 1024), (4, 16384)), attention_iters=10,
    sharegpt=LogNormalWorkloadConfig(num_requests=128), mixed=WorkloadConfig(num_requests=512),
    num_warmup_requests=16,
)
TINY = BenchSizes(
    copy_bytes=64 << 20, copy_iters=5,
    decode_batches=(1, 2, 4), decode_context=32, decode_steps=3, decode_warmup_steps=1,
    decode_max_num_batched_tokens=256,
    roofline_points=((1, 16), (4, 16), (1, 48), (4, 48)), roofline_target=(4, 48),
    attention_shapes=((4, 32), (2, 64), (8, 16), (1, 128)), attention_iters=2,
    latency_batches=(1, 4), latency_context=16,
    sharegpt=LogNormalWorkloadConfig(num_requests=6, prompt_median=16, output_median=4, max_prompt_len=32,
                                     max_output_len=8),
    mixed=WorkloadConfig(num_requests=6, max_prompt_len=32, min_output_len=2, max_output_len=8),
    static_batch_size=4, num_warmup_requests=2,
)
