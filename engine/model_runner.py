"""Runs one step: swaps, the forward pass over a flattened batch, sampling."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.block_pool import KVCacheManager
from engine.forward_batch import prepare_forward_batch
from engine.kv_cache import KVCache
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, SamplingBatch
from engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """The tokens sampled in one step, one per request that caught up."""

    requests: list[Request]
    token_ids: list[int]
    sampler_output: SamplerOutput | None
    swap_bytes: int = 0
    swap_seconds: float = 0.0  # host clock; 0 on CUDA, where swaps are asynchronous
    num_prefill_tokens: int = 0  # prompt (or recompute) tokens in the forward pass


class ModelRunner:
    """Owns the model, its KV tensors and the sampler; runs one step at a time."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        kv_manager: KVCacheManager,
        num_heads: int,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        layout = kv_cache.layout
        self.block_size = layout.block_size
        self.num_heads = num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = layout.head_dim
        self.dtype = layout.dtype
        self.device = kv_cache.blocks.device
        self.backend = model.attention_backend
        # Unseeded rows draw their noise on the device; seeded rows from their own generator.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))
        # Swaps not yet reported: (bytes, host seconds, CUDA start/end events or None).
        self._swap_timings: deque[tuple[int, float, tuple | None]] = deque()

    # -------------------------------------------------------------- execution
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Swap, run the forward pass over the scheduled tokens, sample."""
        swap_bytes, swap_seconds = self._swap(out)
        if not out.requests:
            return ModelRunnerOutput([], [], None, swap_bytes, swap_seconds)
        batch = prepare_forward_batch(out, self.kv_manager, self.device)
        metadata = self.backend.build_metadata(
            batch.attn,
            block_size=self.block_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
        )
        hidden = self.model(
            batch.input_ids, batch.positions, self.kv_cache.layers, batch.attn, metadata
        )  # [N, hidden]
        if not batch.sample_requests:
            return ModelRunnerOutput([], [], None, swap_bytes, swap_seconds, batch.num_prefill_tokens)
        logits = self.model.compute_logits(hidden[batch.sample_indices])  # [S, vocab]
        sampling = self._sampling_batch(batch.sample_requests)
        sampled = self.sampler(logits, sampling)
        return ModelRunnerOutput(
            batch.sample_requests,
            sampled.token_ids,
            sampled,
            swap_bytes,
            swap_seconds,
            batch.num_prefill_tokens,
        )

    def _swap(self, out: SchedulerOutput) -> tuple[int, float]:
        """The step's swap copies: (bytes, seconds on the host clock; 0 on CUDA).

        On CUDA the copies are asynchronous (see KVCache), so they are timed with
        events and reported by `finished_swaps` once the GPU has done them."""
        if not (out.swap_out or out.swap_in):
            return 0, 0.0
        started = time.perf_counter()
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        num_bytes = self.kv_cache.swap_out(out.swap_out) + self.kv_cache.swap_in(out.swap_in)
        if events is None:
            seconds = time.perf_counter() - started
            self._swap_timings.append((num_bytes, seconds, None))
            return num_bytes, seconds
        events[1].record()
        self._swap_timings.append((num_bytes, 0.0, events))
        return num_bytes, 0.0

    def finished_swaps(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of each swap the device has finished since the last call."""
        finished = []
        while self._swap_timings:
            num_bytes, seconds, events = self._swap_timings[0]
            if events is not None:
                if not events[1].query():
                    break
                seconds = events[0].elapsed_time(events[1]) / 1000
            finished.append((num_bytes, seconds))
            self._swap_timings.popleft()
        return finished

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        params = [r.sampling_params for r in requests]
        generators = [r.generator for r in requests]
        histories = None
        if any(p.repetition_penalty != 1.0 for p in params):
            histories = [r.all_token_ids for r in requests]
        banned = None
        if any(p.min_tokens for p in params):
            banned = [
                list(r.eos_token_ids) + list(p.stop_token_ids)
                if r.num_output_tokens < p.min_tokens
                else []
                for r, p in zip(requests, params)
            ]
        return SamplingBatch.build(params, generators, histories, banned_token_ids=banned)
