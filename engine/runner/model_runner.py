"""Runs one step: swaps, the forward pass over a flattened batch (or a static decode batch), sampling."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.kv.cache import KVCache
from engine.kv.manager import KVCacheManager
from engine.request import Request
from engine.runner.decode_graphs import GraphCapture, StaticDecode, graph_batch_sizes
from engine.runner.forward_batch import ForwardBatch, prepare_forward_batch
from engine.sampling.grammar import bitmask_words, fill_bitmask
from engine.sampling.inputs import sampling_batch
from engine.sampling.prompt_logprobs import PendingPromptLogprobs
from engine.sampling.sampler import SampledTokens, Sampler, SamplerOutput
from engine.scheduler import SchedulerOutput

# The kinds of host-device block copies a step makes (ModelRunner.finished_copies).
SWAP, OFFLOAD, RELOAD = "swap", "offload", "reload"


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """The tokens sampled in one step, one per request that caught up."""

    requests: list[Request]
    token_ids: list[int]  # one per sampled row: a request checking k proposals has k+1 rows
    sampler_output: SamplerOutput | None
    swap_bytes: int = 0  # its host-device block copies: swaps, and the host tier's
    swap_seconds: float = 0.0  # host clock; 0 on CUDA, where they are asynchronous
    num_prefill_tokens: int = 0  # prompt (or recompute) tokens in the forward pass
    seconds: float = 0.0  # the step's time on the device (CUDA events), or on the host clock (CPU)
    wait_seconds: float = 0.0  # host time `LaunchedStep.result` spent waiting for the device
    prompt_logprobs: list = ()  # its prefill chunks' prompt logprobs (engine.sampling.prompt_logprobs.record)
    sample_counts: tuple[int, ...] | None = None  # rows per request (ForwardBatch.sample_counts)

    @property
    def num_spec_tokens(self) -> int:
        """Proposals checked: the rows sampled beyond one per request."""
        return 0 if self.sample_counts is None else sum(self.sample_counts) - len(self.sample_counts)


class LaunchedStep:
    """A step whose work is queued on the device; `result` waits for its tokens.

    On CUDA, launching returns as soon as the kernels are queued (the host can
    schedule the next step meanwhile) and `result` is the step's one wait on the
    device. On CPU the work is done by the time `launch` returns.
    """

    __slots__ = ("requests", "sampled", "swap_bytes", "swap_seconds", "num_prefill_tokens", "events",
                 "host_seconds", "deferred", "prompt_logprobs", "sample_counts",
                 "generator_states", "_output")

    def __init__(self, requests: list[Request], sampled: SampledTokens | None, swap_bytes: int,
                 swap_seconds: float, num_prefill_tokens: int, events: tuple | None, host_seconds: float) -> None:
        self.requests = requests  # [S] the requests that sample, in row order
        self.sampled = sampled  # their tokens, on the device
        self.swap_bytes = swap_bytes
        self.swap_seconds = swap_seconds
        self.num_prefill_tokens = num_prefill_tokens
        # CUDA: events recorded before the step's first and after its last launch (on the
        # device's timeline: the gap to the next step's first is the device idling).
        self.events = events
        self.host_seconds = host_seconds  # launching it (on CPU: running it)
        # Sampling that waits for the step before's tokens (its rows' grammars must see
        # them first): (logits, sampling batch, last token ids); None: launched.
        self.deferred: tuple | None = None
        self.prompt_logprobs: PendingPromptLogprobs | None = None
        self.sample_counts: tuple[int, ...] | None = None  # ForwardBatch.sample_counts
        # Seeded rows that checked proposals: (request, its generator's state before the
        # step's draws), for the engine to rewind it past the draws of rejected tokens.
        self.generator_states: list[tuple[Request, torch.Tensor]] = []
        self._output: ModelRunnerOutput | None = None

    @property
    def sampled_token_ids(self) -> torch.Tensor | None:
        """[S] int64 on the device, for the next step's pending inputs."""
        return None if self.sampled is None else self.sampled.token_ids

    def result(self) -> ModelRunnerOutput:
        """Wait for the step's tokens (once; later calls return the same output)."""
        if self._output is None:
            assert self.deferred is None, "ModelRunner.sample_deferred first"
            started = time.perf_counter()
            sampler_output = None if self.sampled is None else self.sampled.result()
            if self.events is not None:
                # Right behind the tokens' copy, or, when nothing was sampled, the step's end:
                # its time is then known.
                self.events[1].synchronize()
            wait_seconds = time.perf_counter() - started
            events = self.events
            seconds = self.host_seconds if events is None else events[0].elapsed_time(events[1]) / 1e3
            self._output = ModelRunnerOutput(
                self.requests,
                [] if sampler_output is None else sampler_output.token_ids,
                sampler_output,
                self.swap_bytes,
                self.swap_seconds,
                self.num_prefill_tokens,
                seconds,
                wait_seconds,
                () if self.prompt_logprobs is None else self.prompt_logprobs.result(),
                self.sample_counts,
            )
        return self._output


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
        # Decode-only steps on persistent inputs (CUDA graphs); None: every step eager.
        self.static_decode: StaticDecode | None = None
        # Copies not yet reported: (kind, bytes, host seconds, CUDA start/end events or None).
        self._copy_timings: deque[tuple[str, int, float, tuple | None]] = deque()

    def use_static_decode(self, max_num_seqs: int, max_model_len: int, capture: bool) -> GraphCapture | None:
        """Run decode-only steps of up to max_num_seqs sequences on persistent inputs
        (engine/runner/decode_graphs.py), captured as CUDA graphs with `capture`."""
        self.static_decode = StaticDecode(
            self.model,
            self.kv_cache.layers,
            self.kv_manager,
            self.backend,
            batch_sizes=graph_batch_sizes(max_num_seqs),
            max_model_len=max_model_len,
            num_heads=self.num_heads,
            device=self.device,
        )
        return self.static_decode.capture() if capture else None

    # -------------------------------------------------------------- execution
    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step: swaps, the forward pass, sampling. Decodes whose input token is
        still PENDING take it from `previous` (the step in flight) on the device."""
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        started = time.perf_counter()
        swap_bytes, swap_seconds = self._copy_blocks(out)
        sampled = deferred = prompt_logprobs = sample_counts = None
        sample_requests: list[Request] = []
        num_prefill_tokens = 0
        generator_states: list[tuple[Request, torch.Tensor]] = []
        if out.requests:
            static = self.static_decode.prepare(out) if self.static_decode is not None else None
            if static is not None:
                batch, graph_key = static
            else:
                batch = prepare_forward_batch(out, self.kv_manager, self.device)
            batch.fill_pending_inputs(None if previous is None else previous.sampled_token_ids)
            if static is not None:
                logits = self.static_decode.run(batch, graph_key)
            else:
                logits, prompt_logprobs = self._forward(batch)
            sample_requests, sample_counts = batch.sample_requests, batch.sample_counts
            num_prefill_tokens = batch.num_prefill_tokens
            row_requests, generator_states = _sample_rows(sample_requests, sample_counts)
            if sample_requests:
                sampling = sampling_batch(row_requests, self.device)
                last_token_ids = (batch.input_ids.index_select(0, batch.sample_indices) if sampling.needs_last_token
                                  else None)
                if previous is not None and any(r.grammar is not None for r in sample_requests):
                    # A grammar's mask needs the token the step in flight samples: the engine
                    # samples this step once it has those tokens (its one wait on the device).
                    deferred = (logits, sampling, last_token_ids)
                else:
                    sampled = self._sample(row_requests, logits, sampling, last_token_ids)
        if events is not None and deferred is None:
            events[1].record()
        step = LaunchedStep(sample_requests, sampled, swap_bytes, swap_seconds, num_prefill_tokens, events,
                            time.perf_counter() - started)
        step.deferred = deferred
        step.prompt_logprobs = prompt_logprobs
        step.sample_counts, step.generator_states = sample_counts, generator_states
        return step

    @torch.inference_mode()
    def sample_deferred(self, step: LaunchedStep) -> None:
        """Launch a step's deferred sampling: its rows' grammars have seen every token before."""
        logits, sampling, last_token_ids = step.deferred
        step.deferred = None
        step.sampled = self._sample(step.requests, logits, sampling, last_token_ids)
        if step.events is not None:
            step.events[1].record()

    def _sample(self, requests: list[Request], logits: torch.Tensor, sampling, last_token_ids) -> SampledTokens:
        rows = [row for row, request in enumerate(requests) if request.grammar is not None]
        grammar = None
        if rows:
            bitmask = fill_bitmask([requests[row].grammar for row in rows], bitmask_words(logits.shape[1]),
                                   self.device)
            pinned = self.device.type == "cuda"
            grammar = (torch.tensor(rows, pin_memory=pinned).to(self.device, non_blocking=True), bitmask)
        return self.sampler.sample(logits, sampling, last_token_ids, grammar)

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor | None, PendingPromptLogprobs | None]:
        """The eager forward pass: logits [S, V] of the rows that sample (None: no row does),
        and the prompt logprobs its prefill chunks give (None: none asked)."""
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
        prompt_logprobs = None
        if batch.prompt_rows:
            prompt_logprobs = PendingPromptLogprobs.launch(self.model, hidden, list(batch.prompt_rows))
        if not batch.sample_requests:
            return None, prompt_logprobs
        return self.model.compute_logits(hidden[batch.sample_indices]), prompt_logprobs  # [S, vocab]

    def _copy_blocks(self, out: SchedulerOutput) -> tuple[int, float]:
        """The step's host-device copies, before its forward pass: the swaps, then the prefix
        cache's host tier's write-through and reloads (engine/kv/host_tier.py). Returns (bytes,
        seconds on the host clock; 0 on CUDA, where they are asynchronous: see KVCache)."""
        num_bytes, seconds = 0, 0.0
        for kind, copies_out, copies_in in ((SWAP, out.swap_out, out.swap_in), (OFFLOAD, out.offload, ()),
                                            (RELOAD, (), out.reload)):
            if copies_out or copies_in:
                moved, taken = self._timed_copy(kind, copies_out, copies_in)
                num_bytes, seconds = num_bytes + moved, seconds + taken
        return num_bytes, seconds

    def _timed_copy(self, kind: str, copies_out, copies_in) -> tuple[int, float]:
        """One kind of copy, timed: on the host clock, or with events on CUDA (reported by
        `finished_copies` once the GPU has done them)."""
        started = time.perf_counter()
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        num_bytes = self.kv_cache.swap_out(copies_out) + self.kv_cache.swap_in(copies_in)
        if events is None:
            seconds = time.perf_counter() - started
            self._copy_timings.append((kind, num_bytes, seconds, None))
            return num_bytes, seconds
        events[1].record()
        self._copy_timings.append((kind, num_bytes, 0.0, events))
        return num_bytes, 0.0

    def finished_copies(self) -> list[tuple[str, int, float]]:
        """(kind: SWAP, OFFLOAD or RELOAD, bytes, seconds) of each copy the device has finished
        since the last call."""
        finished = []
        while self._copy_timings:
            kind, num_bytes, seconds, events = self._copy_timings[0]
            if events is not None:
                if not events[1].query():
                    break
                seconds = events[0].elapsed_time(events[1]) / 1000
            finished.append((kind, num_bytes, seconds))
            self._copy_timings.popleft()
        return finished


def _sample_rows(requests: list[Request], counts: tuple[int, ...] | None
                 ) -> tuple[list[Request], list[tuple[Request, torch.Tensor]]]:
    """The request of each sampled row (a row checking k proposals samples k+1 times), and
    the state of each such seeded row's generator before the step draws from it."""
    if counts is None:
        return requests, []
    rows = [request for request, count in zip(requests, counts) for _ in range(count)]
    states = [(request, request.generator.get_state()) for request, count in zip(requests, counts)
              if count > 1 and request.generator is not None and not request.sampling_params.is_greedy]
    return rows, states
