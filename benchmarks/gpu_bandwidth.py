"""Memory-bound measurements for benchmarks/gpu.py: copy bandwidth, Baton's decode
step against the bytes it must read, and the paged attention kernel alone.

A decode step of a dense model reads every weight once and each sequence's whole
KV context once, and does little arithmetic per byte, so its floor is

    step time >= (weight bytes + KV bytes) / memory bandwidth

and the measured device-to-device copy bandwidth stands in for that bandwidth. Of a
mixture of experts a step reads only the experts its tokens route to, and FP8 weights
are a byte each (`decode_weight_bytes`).
Device time comes from CUDA events on a GPU and from `time.perf_counter` on CPU
(the CPU smoke run).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter

import numpy as np
import torch

# Prompt ids are drawn above the special-token range, as in benchmarks/workload.py.
MIN_TOKEN_ID = 100
# GPU clock cycles of spinning before timed calls (~10 ms at 2 GHz): longer than the
# host takes to queue them.
QUEUE_FILL_CYCLES = 20_000_000


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_on_device(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> list[float]:
    """Seconds per call of `fn`, one entry per timed call, after `warmup` untimed calls
    (one on CPU, where nothing compiles on first use)."""
    for _ in range(warmup if device.type == "cuda" else min(warmup, 1)):
        fn()
    synchronize(device)
    if device.type != "cuda":
        seconds = []
        for _ in range(iters):
            start = perf_counter()
            fn()
            seconds.append(perf_counter() - start)
        return seconds
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    # The device idles on a spin kernel while the host queues every timed call, so no
    # call waits on the host's launch overhead and the events time device work only.
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(QUEUE_FILL_CYCLES)
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]


# ----------------------------------------------------------------------------- copy bandwidth


@dataclass(frozen=True)
class CopyBandwidth:
    """`dst.copy_(src)` of one buffer; bytes counted as read plus written."""

    buffer_bytes: int
    iterations: int
    median_seconds: float
    min_seconds: float

    @property
    def gb_per_s(self) -> float:
        return 2 * self.buffer_bytes / self.median_seconds / 1e9

    @property
    def best_gb_per_s(self) -> float:
        return 2 * self.buffer_bytes / self.min_seconds / 1e9


def measure_copy_bandwidth(device: torch.device, buffer_bytes: int, iters: int) -> CopyBandwidth:
    num_elements = buffer_bytes // 4
    src = torch.ones(num_elements, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = time_on_device(lambda: dst.copy_(src), device, iters)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the buffers stay out of what the engines later count as used
    return CopyBandwidth(num_elements * 4, iters, statistics.median(seconds), min(seconds))


# ----------------------------------------------------------------------------- decode steps


# Stacked expert weights (engine/model/arch.py's names), [E, N, K] each.
_EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def decode_weight_bytes(arch, dtype: torch.dtype, quantization=None, batch_size: int = 1) -> int:
    """Weight bytes one decode step of `batch_size` sequences reads: every parameter except
    the embedding table, of which a step gathers only its batch's rows (a tied embedding is
    read whole as the LM head); of each sparse layer's experts only those the batch routes
    to (`expected_active_experts`: exactly top-k at batch 1); and with an FP8
    `quantization` (engine/model/quantization.py) one byte per FP8 weight plus its float32
    scales, one per output channel or per block, as a GPU stores them. Counted from the
    architecture, so CPU-packed copies do not change it (pass no quantization for a CPU,
    which keeps FP8-rounded weights in `dtype`)."""
    from engine.model.arch import parameter_shapes
    from engine.model.quantization import is_quantized_weight

    element_size = torch.empty((), dtype=dtype).element_size()
    shapes = parameter_shapes(arch)
    if not arch.tie_word_embeddings:
        del shapes["embed_tokens.weight"]
    active = 0.0 if arch.moe is None else expected_active_experts(arch.moe, batch_size) / arch.moe.num_experts
    total = 0.0
    for name, shape in shapes.items():
        if quantization is not None and is_quantized_weight(name):
            num_bytes = math.prod(shape) + fp8_scale_count(shape, quantization) * 4
        else:
            num_bytes = math.prod(shape) * element_size
        # Stacked experts [E, N, K]: a step reads the rows of the experts its tokens chose.
        total += num_bytes * active if name.endswith(_EXPERT_WEIGHTS) else num_bytes
    return round(total)


def expected_active_experts(moe, batch_size: int) -> float:
    """Distinct experts a layer's `batch_size` tokens route to, expected under uniform
    routing: each expert is missed by a token with probability 1 - k/E, so
    E * (1 - (1 - k/E)^b) (k at batch 1, all E as b grows)."""
    return moe.num_experts * (1.0 - (1.0 - moe.top_k / moe.num_experts) ** batch_size)


def fp8_scale_count(shape: tuple[int, ...], quantization) -> int:
    """float32 scales of an FP8 weight of `shape` ([N, K], or [E, N, K] stacked): one per
    output channel, or one per (bn, bk) block of each matrix."""
    *leading, num_rows, num_cols = shape
    if quantization.layout == "block":
        block_n, block_k = quantization.block_size
        per_matrix = -(-num_rows // block_n) * -(-num_cols // block_k)
    else:
        per_matrix = num_rows
    return math.prod(leading) * per_matrix


def kv_bytes_per_token(layout) -> int:
    """K and V of one token across all layers."""
    return layout.bytes_per_block // layout.block_size


@dataclass(frozen=True)
class DecodePoint:
    """Baton's decode steps with `batch_size` sequences of about `context_len` tokens."""

    batch_size: int
    context_len: int  # prompt length; the timed steps see a little more (mean_context_len)
    num_steps: int
    step_seconds: float  # median over the timed steps
    mean_context_len: float  # keys each sequence attends to, averaged over the timed steps
    weight_bytes: int
    kv_bytes: float  # KV bytes read per step, averaged over the timed steps

    @property
    def ms_per_step(self) -> float:
        return self.step_seconds * 1e3

    @property
    def ms_per_token(self) -> float:
        return self.ms_per_step / self.batch_size

    @property
    def tokens_per_second(self) -> float:
        return self.batch_size / self.step_seconds

    @property
    def bytes_per_step(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_step / self.step_seconds / 1e9


def decode_blocks_needed(llm, batch_size: int, context_len: int, num_steps: int, warmup_steps: int) -> int:
    """KV blocks the measurement holds at its end (see measure_decode's max_tokens)."""
    block_size = llm.engine.kv_layout.block_size
    max_tokens = _decode_max_tokens(llm, batch_size, context_len, num_steps, warmup_steps)
    return batch_size * math.ceil((context_len + max_tokens) / block_size)


def _decode_max_tokens(llm, batch_size: int, context_len: int, num_steps: int, warmup_steps: int) -> int:
    # A request prefilled early decodes while the others prefill: one token per prefill step.
    budget = llm.engine.config.scheduler.max_num_batched_tokens
    prefill_steps = math.ceil(batch_size * context_len / budget) + 1
    return prefill_steps + warmup_steps + num_steps + 4


@contextmanager
def decoding(engine, batch_size: int, context_len: int, max_tokens: int, warmup_steps: int,
             seed: int = 0) -> Iterator[list]:
    """`batch_size` random greedy prompts of `context_len` tokens, prefilled and then
    decoded for `warmup_steps` steps: the requests, every one of them decoding. On exit
    the ones still running are aborted and the engine is stepped until it is idle."""
    from engine import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = rng.integers(MIN_TOKEN_ID, engine.vocab_size, size=(batch_size, context_len))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request(prompt.tolist(), params) for prompt in prompts]
    try:
        while any(r.num_output_tokens == 0 for r in requests):
            engine.step()
        for _ in range(warmup_steps):
            engine.step()
        yield requests
    finally:
        for request in requests:
            if not request.is_finished:
                engine.abort_request(request.request_id)
        while engine.has_unfinished_requests():  # hands out the aborted requests' outputs
            engine.step()


def measure_decode(llm, batch_size: int, context_len: int, num_steps: int, warmup_steps: int,
                   seed: int = 0) -> DecodePoint:
    """Prefill `batch_size` random prompts of `context_len` tokens, then time `num_steps`
    engine steps in which every one of them decodes (wall clock, device synchronized)."""
    engine = llm.engine
    device = engine.device
    if batch_size > engine.config.scheduler.max_num_seqs:
        raise ValueError(f"batch {batch_size} exceeds max_num_seqs {engine.config.scheduler.max_num_seqs}")
    max_tokens = _decode_max_tokens(llm, batch_size, context_len, num_steps, warmup_steps)
    seconds, contexts = [], []
    with decoding(engine, batch_size, context_len, max_tokens, warmup_steps, seed) as requests:
        for _ in range(num_steps):
            # The step's new token (sampled last step) attends to every token so far.
            contexts.append(sum(r.num_tokens for r in requests))
            synchronize(device)
            start = perf_counter()
            out = engine.step()
            synchronize(device)
            seconds.append(perf_counter() - start)
            if len(out.outputs) != batch_size or any(o.finished for o in out.outputs):
                raise RuntimeError(f"batch {batch_size} x {context_len}: a step decoded "
                                   f"{len(out.outputs)} sequences (preempted or finished early)")
    layout = engine.kv_layout
    mean_tokens = statistics.fmean(contexts)
    return DecodePoint(
        batch_size=batch_size,
        context_len=context_len,
        num_steps=num_steps,
        step_seconds=statistics.median(seconds),
        mean_context_len=mean_tokens / batch_size,
        weight_bytes=decode_weight_bytes(engine.runner.model.arch, layout.dtype, batch_size=batch_size),
        kv_bytes=mean_tokens * kv_bytes_per_token(layout),
    )


# ----------------------------------------------------------------------------- attention kernel


@dataclass(frozen=True)
class AttentionPoint:
    """One `paged_attention` launch (one layer) over a decode-only batch."""

    batch_size: int
    context_len: int
    num_splits: int
    median_seconds: float
    kv_bytes: int  # K and V of every context token, one layer

    @property
    def gb_per_s(self) -> float:
        return self.kv_bytes / self.median_seconds / 1e9


def attention_cache(layout, num_tokens: int, device: torch.device, seed: int = 0):
    """A block-major KVCache of `layout` (all its layers, as the engine's) with room for
    `num_tokens` tokens plus a margin, filled with random values."""
    from engine.kv.cache import KVCache

    num_blocks = math.ceil(num_tokens / layout.block_size) + 64
    cache = KVCache(layout, num_blocks, 0, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache.blocks.normal_(generator=generator)
    return cache


def measure_attention(cache, num_heads: int, batch_size: int, context_len: int, iters: int,
                      num_sms: int, seed: int = 0) -> AttentionPoint:
    """Time `paged_attention` on the cache's middle layer: `batch_size` sequences decoding
    one token each over `context_len` keys, their blocks scattered at random."""
    from engine.kernels.triton_attention import choose_num_splits, paged_attention

    layout = cache.layout
    device = cache.blocks.device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = math.ceil(context_len / layout.block_size)
    if batch_size * blocks_per_seq > cache.num_blocks:
        raise ValueError(f"{batch_size} x {context_len} tokens do not fit the {cache.num_blocks}-block cache")
    block_ids = torch.randperm(cache.num_blocks, generator=generator)[: batch_size * blocks_per_seq]
    block_tables = block_ids.view(batch_size, blocks_per_seq).to(device)  # [B, max_blocks] int64
    query = torch.randn(batch_size, num_heads, layout.head_dim, generator=generator).to(device, layout.dtype)
    out = torch.empty_like(query)  # [B, H, Dh]
    query_start = torch.arange(batch_size + 1, dtype=torch.int64, device=device)  # one new token each
    seq_lens = torch.full((batch_size,), context_len, dtype=torch.int64, device=device)
    num_splits = choose_num_splits(batch_size, layout.num_kv_heads, context_len, num_sms)
    key_cache, value_cache = cache.layers[layout.num_layers // 2]
    scale = layout.head_dim ** -0.5

    def launch() -> None:
        paged_attention(query, key_cache, value_cache, out, query_start, seq_lens, block_tables,
                        scale, max_query_len=1, max_seq_len=context_len, num_splits=num_splits)

    seconds = time_on_device(launch, device, iters)
    if not torch.isfinite(out).all():
        raise RuntimeError(f"paged_attention produced non-finite values at {batch_size} x {context_len}")
    element_size = cache.blocks.element_size()
    kv_bytes = batch_size * context_len * 2 * layout.num_kv_heads * layout.head_dim * element_size
    return AttentionPoint(batch_size, context_len, num_splits, statistics.median(seconds), kv_bytes)


def num_streaming_multiprocessors(device: torch.device) -> int:
    """The GPU's SM count; 1 on CPU (the interpreter runs one program at a time)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
