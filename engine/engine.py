"""LLMEngine: the step-level API (add_request / step / abort) the workers drive."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, detokenize
from engine.kv.cache import KVCache, KVLayout
from engine.kv.landing import Landing
from engine.kv.manager import KVCacheManager, cdiv
from engine.model.loader import LoadedModel, load_model
from engine.outputs import KvReceive, RequestOutput, StepOutput
from engine.request import InvalidRequestError, Request
from engine.runner.decode_graphs import GraphCapture, graph_batch_sizes, static_decode_bytes
from engine.runner.device import engine_device
from engine.runner.memory import (DeviceMemory, GraphReserve, check_share_is_free, kv_cache_budget, profile_memory,
                                  read_device_memory)
from engine.runner.model_runner import RELOAD, ModelRunner
from engine.runner.overlap import Overlap, UnresolvedStep
from engine.runner.step_outputs import note_tokens, record_chunks, running_output
from engine.runner.step_time import StepTimeModel
from engine.sampling import prompt_logprobs
from engine.sampling.grammar import GrammarCompiler
from engine.sampling.request_inputs import bad_word_ids, check_sampling_ids, check_token_ids, start_grammar
from engine.sampling.sampler import make_generator, skip_sample_draw
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerStats
from engine.scheduler.preemption import PreemptionCostModel
from engine.spec_decode.draft import DraftProposer
from engine.spec_decode.speculator import Speculator
from engine.timeline import StepBatch

logger = logging.getLogger(__name__)


class LLMEngine:
    """One model, one paged KV cache, one scheduler; advanced one step at a time.

    Not thread-safe: one thread calls add_request / abort_request / step (the
    workers run it on a dedicated thread, off the event loop).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = engine_device(config.device)
        # This process's share of the GPU must be free before anything is loaded (engine/runner/memory.py).
        memory_at_start = None
        if self.device.type == "cuda" and not config.cache.is_sized:
            memory_at_start = read_device_memory(self.device)
            check_share_is_free(memory_at_start, config.cache.gpu_memory_utilization, self.device)
        if loaded is None:
            loaded = load_model(config.model, config.dtype, config.max_model_len, config.attention_backend,
                                self.device, config.seed, revision=config.revision, tokenizer=config.tokenizer,
                                served_model_name=config.served_model_name, quantization=config.quantization)
        self.model_name, self.model_load, self.tokenizer = loaded.name, loaded.load, loaded.tokenizer
        self.eos_token_ids, self.max_model_len = loaded.eos_token_ids, loaded.max_model_len
        arch = loaded.arch
        self.vocab_size = arch.vocab_size
        # Structured output: compiled off the step (the async engine prepares each
        # constraint on a worker thread); None without a tokenizer.
        self.grammars = None if self.tokenizer is None else GrammarCompiler(self.tokenizer, self.vocab_size)
        block_size = config.cache.block_size
        self.kv_layout = KVLayout(arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, config.dtype)
        # CUDA graphs of decode steps: on a GPU, unless enforce_eager or the backend cannot.
        graph_sizes = ()
        if (self.device.type == "cuda" and not config.enforce_eager
                and loaded.model.attention_backend.supports_static_batches):
            graph_sizes = graph_batch_sizes(config.scheduler.max_num_seqs)
        num_blocks = self._size_kv_cache(loaded, memory_at_start, graph_sizes)
        self.kv_manager, self.kv_cache = self._make_kv_cache(num_blocks)
        self.cost_model = PreemptionCostModel(self.kv_layout.bytes_per_block)
        self.step_time = StepTimeModel(self.cost_model)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.cost_model, self.max_model_len)
        self.scheduler.decode_step_s = lambda n, context: self.step_time.decode.line().seconds(n, context)
        self.runner = ModelRunner(loaded.model, self.kv_cache, self.kv_manager, num_heads=arch.num_heads,
                                  seed=config.seed)
        self.graph_capture = self._capture_graphs() if graph_sizes else None
        self.overlap = Overlap(self._overlaps(), self.kv_manager, self.runner)
        self.speculator = self._speculator()
        # Set (AsyncEngine): given a step's admissions with remote KV as it is scheduled, not in its output.
        self.on_kv_receives: Callable[[list[KvReceive]], None] | None = None
        self._request_counter = itertools.count()
        self._aborted_outputs: list[RequestOutput] = []

    def _make_kv_cache(self, num_blocks: int) -> tuple[KVCacheManager, KVCache]:
        """The block tables over a device pool of `num_blocks` and the host pool (swap
        preemption's blocks and the prefix cache's host tier, engine/kv/host_tier.py), and their tensors."""
        cache, block_size = self.config.cache, self.config.cache.block_size
        num_swap = cache.resolve_num_swap_blocks(self.kv_layout.bytes_per_block)
        num_offload = cache.resolve_num_offload_blocks(self.kv_layout.bytes_per_block)
        manager = KVCacheManager(num_blocks, num_swap, block_size,
                                 max_blocks_per_seq=cdiv(self.max_model_len, block_size),
                                 initial_rows=min(self.config.scheduler.max_num_seqs, 1024),
                                 enable_prefix_caching=cache.enable_prefix_caching, num_offload_blocks=num_offload)
        return manager, KVCache(self.kv_layout, num_blocks, num_swap + num_offload, self.device,
                                shareable=cache.shareable)

    def _speculator(self) -> Speculator | None:
        """Speculative decoding (engine/spec_decode): proposals before each step, acceptance after."""
        config, spec = self.config, self.config.speculative
        draft = None if spec.method != "draft" else DraftProposer(
            spec.draft_model, config.dtype, self.max_model_len, self.vocab_size, self.device, config.cache.block_size,
            spec.draft_num_kv_blocks or self.kv_manager.pool.num_blocks, config.attention_backend, config.seed)
        return None if spec.method is None else Speculator(spec, self.step_time, self.max_model_len, self.vocab_size,
                                                           config.dtype, draft, backoff_empty=self.overlap.enabled)

    def _overlaps(self) -> bool:
        """Overlapped scheduling (the step launched last, its tokens not yet reported: see
        `step`): as configured, else on CUDA. Speculating, the steps that check proposals run plain."""
        overlap = self.config.overlap_scheduling
        return self.device.type == "cuda" if overlap is None else overlap

    def _capture_graphs(self) -> GraphCapture:
        """Capture the decode steps' CUDA graphs; warn if they took more memory than sizing kept."""
        capture = self.runner.use_static_decode(self.config.scheduler.max_num_seqs, self.max_model_len, capture=True)
        kept = self.graph_reserve_bytes
        if kept is not None and capture.memory_bytes > kept:
            logger.warning("the CUDA graphs took %.0f MiB, more than the %.0f MiB kept for them when the KV "
                           "cache was sized: lower gpu_memory_utilization if the GPU runs out of memory",
                           capture.memory_bytes / 2**20, kept / 2**20)
        return capture

    def _size_kv_cache(self, loaded: LoadedModel, memory_at_start: DeviceMemory | None,
                       graph_sizes: Sequence[int]) -> int:
        """The KV cache's blocks: as configured, or what the GPU's share holds once a
        profiling forward and the CUDA graphs' reserve are counted (engine/runner/memory.py)."""
        config, arch = self.config, loaded.arch
        self.graph_reserve_bytes: int | None = None  # what sizing the KV cache kept for the graphs
        free_bytes = None
        if memory_at_start is not None:
            reserve = None if not graph_sizes else GraphReserve(graph_sizes[-1], static_decode_bytes(
                loaded.model.attention_backend, graph_sizes, self.max_model_len, config.cache.block_size,
                arch.num_kv_heads, arch.hidden_size, config.dtype))
            profile = profile_memory(loaded.model, self.kv_layout, config, self.max_model_len, self.device,
                                     memory_at_start, reserve)
            free_bytes = kv_cache_budget(profile, config.cache.gpu_memory_utilization, self.kv_layout.bytes_per_block)
            self.graph_reserve_bytes = profile.graph_reserve_bytes
        return config.cache.resolve_num_blocks(self.kv_layout.bytes_per_block, free_bytes)

    # --------------------------------------------------------------- requests
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        prefill_only: bool = False,
        trace: bool = False,
        num_generated_tokens: int = 0,
    ) -> Request:
        """Queue a request; it joins the batch at the next step. Raises ValueError on bad input:
        InvalidRequestError naming the attribute at fault (PromptTooLongError for a prompt that
        reaches max_model_len) for a request this engine could never run.

        With `prefill_only`, the request stops after its first sampled token
        (unless that token ends it) and holds its KV for a handoff: its output
        that step carries `kv_block_ids`, and `release_kv` frees them. With
        `trace`, the request records its timeline (admission, each prefill chunk
        and the batch it ran in, preemptions, the first decode step; see
        engine.timeline) and its outputs carry it off in `events`.

        `num_generated_tokens`: the prompt's last tokens that an earlier attempt at
        the request generated elsewhere (it moved here when that worker was lost); a
        seeded request's generator skips their draws, so its stream continues as if
        undisturbed. The sampling limits are the caller's to count down.

        `deadline`: when the caller gives up on the request (time.monotonic() seconds;
        None: never). Within a priority the queues serve the earliest first, and
        preemption takes one without a deadline, then the latest, first; ending the
        request at its deadline is the caller's (abort).
        """
        request = self._new_request(prompt, sampling_params, request_id, priority, trace, num_generated_tokens,
                                    deadline)
        request.prefill_only = prefill_only
        request.output_start -= num_generated_tokens
        start_grammar(self.grammars, request)
        self.scheduler.add_request(request)
        return request

    def add_prefilled_request(
        self,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        trace: bool = False,
        num_generated_tokens: int = 0,
        landing: Landing | None = None,
    ) -> Request:
        """Queue a request whose prompt another engine prefilled and sampled `first_token_id` for.

        When admitted, its prompt's blocks are allocated and reported in the
        step's `kv_receives`; the caller fills them, then calls
        `complete_kv_receive`. It then decodes from the first token as if it
        had been prefilled here (a seeded request's generator skips the draw
        the other engine made; `num_generated_tokens` and `deadline` as in add_request).
        With a `landing` (blocks `scheduler.landing` set aside, which the caller is filling
        already) it is admitted now, in them; if it is refused they go under a fence
        named by the landing's ticket, for the caller to release once nothing writes into them.
        """
        try:
            check_token_ids("first_token_id", [first_token_id], self.vocab_size, is_list=False)
            request = self._new_request(list(prompt_token_ids), sampling_params, request_id, priority, trace,
                                        num_generated_tokens + 1, deadline)
            request.all_token_ids.append(first_token_id)
            request.prompt_logprobs = None  # the engine that prefilled it computed them
            request.output_start -= num_generated_tokens
            start_grammar(self.grammars, request)
            request.kv_remote = True
            self.scheduler.add_request(request, landing)
        except BaseException:
            if landing is not None:  # (refused before its blocks became its table)
                self.scheduler.landing.refuse(landing)
            raise
        return request

    def complete_kv_receive(self, request_id: str, ok: bool, fence_id: str | None = None,
                            landing: str | None = None) -> bool:
        """The KV of a `kv_receives` entry is in place (`ok`), or never will be: the request
        then prefills its prompt here. False if the request is gone (aborted meanwhile).
        `landing`: the entry's ticket, if it landed in blocks set aside.

        `fence_id`: the receive failed with its blocks in doubt (the sender may still
        write into them): they stay out of the pool under that id, whether or not the
        request is gone, until `release_fence(fence_id)`."""
        return self.scheduler.complete_kv_receive(request_id, ok, fence_id, landing) is not None

    def release_fence(self, fence_id: str) -> int:
        """Free the blocks of a fence: nothing writes into them any more. How many."""
        return self.kv_manager.release_fence(fence_id)

    def release_kv(self, request_id: str) -> bool:
        """Free the KV a prefill_only request holds (after the handoff, or when given up)."""
        return self.scheduler.release_held(request_id) is not None

    def _new_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        trace: bool = False,
        num_draws_made: int = 0,
        deadline: float | None = None,
    ) -> Request:
        """A new request; a seeded one's generator has skipped `num_draws_made` draws
        (tokens sampled for it elsewhere)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        prompt_token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", "prompt is empty")
        check_token_ids("prompt_token_ids", prompt_token_ids, self.vocab_size)
        check_sampling_ids(params, self.vocab_size)
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            deadline=deadline,
            eos_token_ids=self.eos_token_ids,
        )
        if params.bad_words:
            request.bad_word_ids = bad_word_ids(self.tokenizer, params.bad_words)
        if trace:
            request.events = []
        if params.seed is not None:
            request.generator = make_generator(params.seed, self.device)
        if num_draws_made and request.generator is not None and not params.is_greedy:
            skip_sample_draw(request.generator, self.vocab_size, self.config.dtype, num_draws_made)
        if params.stop and self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        return request

    def abort_request(self, request_id: str) -> bool:
        """End a request in any state and free all it holds; reported in the next step's outputs."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return False
        self._aborted_outputs.append(self._final_output(request, []))
        return True

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._aborted_outputs)
                or self.overlap.step is not None)

    def has_work(self) -> bool:
        """Whether `step` would do anything (HELD and RECEIVING requests wait on a handoff)."""
        return (self.scheduler.has_schedulable_requests() or bool(self._aborted_outputs)
                or self.overlap.step is not None)

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)

    # ------------------------------------------------------------------- step
    def step(self) -> StepOutput:
        """Schedule and launch one step, then report each request's new tokens.

        Plain: the tokens of the step just launched. Overlapped (`overlap_scheduling`):
        the tokens of the step before it, so the host schedules and prepares step N+1
        while the device runs step N (engine/runner/overlap.py). Speculating, a step
        whose rows check proposals needs their last tokens: the step in flight is
        completed first and this one runs plain.
        """
        started = entered = time.perf_counter()
        outputs = []
        plan = self.speculator.plan(self.scheduler.running) if self.speculator is not None else []
        if plan and self.overlap.step is not None:
            outputs += self.overlap.drain(self._complete)
            started = time.perf_counter()
        launched = self._launch(plan) if self.scheduler.has_schedulable_requests() else None
        outputs += self.overlap.turn(launched, self._complete, started, plain=bool(plan))
        aborted, self._aborted_outputs = self._aborted_outputs, []  # (ended between calls)
        self.scheduler.counters.busy_seconds_total += time.perf_counter() - entered  # (in the next step's window)
        return StepOutput(aborted + outputs, launched.kv_receives if launched is not None else [])

    def _launch(self, plan: list) -> UnresolvedStep:
        scheduler = self.scheduler
        if self.speculator is not None:
            self.speculator.propose(scheduler.running, plan)
        sched_out = scheduler.schedule()
        kv_receives = [
            KvReceive(request.request_id, list(self.kv_manager.get_block_ids(request.request_id)),
                      request.num_reused_blocks)
            for request in sched_out.kv_receives
        ]
        if kv_receives and self.on_kv_receives is not None:
            self.on_kv_receives(kv_receives)  # their pulls start now, while this step runs
            kv_receives = []
        # Traced requests scheduled this step: where their work starts, how many tokens they had.
        traced = [
            (request, request.num_computed_tokens, num_new, len(request.all_token_ids))
            for request, num_new in zip(sched_out.requests, sched_out.num_scheduled_tokens)
            if request.events is not None and request.request_id not in sched_out.spec_token_ids
        ]
        launched = self.runner.launch(sched_out, self.overlap.launched_before)
        positions = scheduler.advance(sched_out, launched.requests)
        scheduler.end_step(sched_out)
        batch = None
        if traced:
            batch = StepBatch(
                step_index=scheduler.step_index,
                num_seqs=len(sched_out.requests),
                num_tokens=sched_out.total_num_scheduled_tokens,
            )
            # Recorded at launch, in order with the next schedule's events (on CUDA the
            # chunk may still be running: its time is when it was launched).
            record_chunks(traced, batch)
        return UnresolvedStep(sched_out, launched, positions, batch, kv_receives)

    def _complete(self, step: UnresolvedStep, started: float | None) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs (in the `step` call
        that began at perf_counter `started`; None: not timed)."""
        runner_out = step.launched.result()
        self.kv_manager.release_tier_holds(step.scheduled.tier_holds)  # its copies have run
        prompt_logprobs.record(runner_out.prompt_logprobs)
        requests, proposals = runner_out.requests, step.scheduled.spec_token_ids
        # Requests that ended while the step ran (aborted, or stopped by the step before) get nothing.
        live = [not request.is_finished for request in requests]
        # Each request's tokens: one, or those a row checking proposals keeps (engine/spec_decode).
        kept = [(row, 1) for row in range(len(requests))] if runner_out.sample_counts is None else \
            self.speculator.accept(requests, runner_out.token_ids, runner_out.sample_counts, proposals)
        emitted = [runner_out.token_ids[row:row + count] for row, count in kept]
        if step.launched.generator_states:
            self.speculator.rewind(step.launched.generator_states,
                                   {request.request_id: count for request, (_, count) in zip(requests, kept)})
        finished = {request.request_id for request in self.scheduler.resolve(requests, emitted, step.positions,
                                                                             proposals)}
        outputs: list[RequestOutput] = []
        sampler_out, now = runner_out.sampler_output, time.monotonic()
        all_logprobs = sampler_out.logprobs if sampler_out is not None and sampler_out.logprobs else None
        for index, request in enumerate(requests):
            if not live[index]:
                continue
            row, token_ids = kept[index][0], emitted[index]
            logprobs = None
            if request.logprobs is not None and all_logprobs is not None:
                logprobs = all_logprobs[row:row + len(token_ids)]
            stopped = note_tokens(self.scheduler, request, token_ids, logprobs, now, step.batch)
            if stopped or request.request_id in finished:
                outputs.append(self._final_output(request, token_ids, logprobs))
            else:
                outputs.append(running_output(request, token_ids, logprobs, self.kv_manager))
        # On CUDA copies are not timed apart from the step: learn from steps without swaps.
        if started is not None and not (step.scheduled.has_swaps and self.device.type == "cuda"):
            self.step_time.observe(runner_out, step.scheduled, time.perf_counter() - started)
        for kind, num_bytes, seconds in self.runner.finished_copies():
            self.cost_model.observe_swap(num_bytes, seconds)
            if kind == RELOAD:
                self.kv_manager.tier.reload_seconds += seconds
        return outputs

    def _final_output(
        self, request: Request, new_token_ids: list[int], new_logprobs: list | None = None
    ) -> RequestOutput:
        if self.speculator is not None:
            self.speculator.forget(request)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finished=True,
            finish_reason=request.finish_reason,
            stop_reason=request.finish_stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_host_cached_tokens=request.num_host_cached_tokens,
            text=self.output_text(request),
            new_logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs.take(request),
            timings=request.take_timings(),
            events=None if request.events is None else request.take_events(),
        )

    def output_text(self, request: Request) -> str | None:
        """The request's output text so far (whole, truncated at a stop string)."""
        if self.tokenizer is None:
            return None
        if request.detokenizer is not None:
            if request.detokenizer.stop_matched is None and request.is_finished:
                request.detokenizer.flush()
            return request.detokenizer.text
        return detokenize(
            self.tokenizer,
            request.output_token_ids,
            skip_special_tokens=request.sampling_params.skip_special_tokens,
        )

    # ---------------------------------------------------------------- metrics
    def get_metrics(self, with_queue_times: bool = True) -> SchedulerStats:
        """Scheduler counters, step-time model, speculation; `with_queue_times`: the latest queue times too."""
        stats = replace(self.scheduler.stats(with_queue_times), **self.step_time.estimate()._asdict())
        return stats.with_speculation(self.speculator.stats()) if self.speculator is not None else stats

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
