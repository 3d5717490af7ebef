"""The offline API, in the shape vLLM users know: LLM(...).generate(prompts, params)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.model.loader import LoadedModel
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerStats

Prompt = str | Sequence[int]


class LLM:
    """Generate completions for a list of prompts with continuous batching.

    `model` is "smollm2-135m" (the default), a Hugging Face model directory, or
    a .gguf file. Keyword arguments size the KV cache and the scheduler; see
    CacheConfig and SchedulerConfig for their meaning.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: str | torch.dtype = "float32",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        num_swap_blocks: int | None = None,
        swap_space_bytes: int = 256 * 1024**2,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        scheduler_policy: str = "continuous",
        preemption_mode: str = "auto",
        priority_aging_steps: int = 64,
        admission_reserve_steps: int = 4,
        long_prefill_token_threshold: int = 0,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        attention_backend: str = "auto",
        seed: int = 0,
        loaded_model: LoadedModel | None = None,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            cache=CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                num_swap_blocks=num_swap_blocks,
                swap_space_bytes=swap_space_bytes,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                policy=scheduler_policy,
                preemption_mode=preemption_mode,
                priority_aging_steps=priority_aging_steps,
                admission_reserve_steps=admission_reserve_steps,
                long_prefill_token_threshold=long_prefill_token_threshold,
            ),
            num_threads=num_threads,
            attention_backend=attention_backend,
            seed=seed,
        )
        self.engine = LLMEngine(config, loaded_model)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; results come back in prompt order.

        `prompts` is one prompt or a list; a prompt is a string or a list of
        token ids. `sampling_params` is one SamplingParams for all or one per prompt.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"{len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"{len(priorities)} priorities for {len(prompt_list)} prompts")

        engine = self.engine
        requests = []
        try:
            for prompt, params, prio in zip(prompt_list, params_list, priorities):
                requests.append(engine.add_request(prompt, params, priority=prio))
            pending = {request.request_id for request in requests}
            while pending:
                for output in engine.step().outputs:
                    if output.finished:
                        pending.discard(output.request_id)
        except BaseException:
            for request in requests:
                engine.abort_request(request.request_id)
            raise
        return [
            CompletionOutput(
                request_id=request.request_id,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=request.prompt_token_ids,
                token_ids=request.output_token_ids,
                text=engine.output_text(request) or "",
                finish_reason=request.finish_reason,
                logprobs=request.logprobs,
                queue_time=request.queue_time,
                num_preemptions=request.num_preemptions,
            )
            for prompt, request in zip(prompt_list, requests)
        ]

    def get_metrics(self) -> SchedulerStats:
        """Scheduler counters: queues, KV blocks, preemptions, tokens per step, queue times."""
        return self.engine.get_metrics()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    for prompt in prompts:
        if not isinstance(prompt, str) and not all(isinstance(t, int) for t in prompt):
            raise TypeError("a prompt is a string or a list of token ids")
    return prompts
