"""The offline API, in the shape vLLM users know: LLM(...).generate(prompts, params)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.config import DEFAULT_MODEL, engine_config
from engine.engine import LLMEngine
from engine.envs import configure_process
from engine.model.loader import LoadedModel
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerStats

Prompt = str | Sequence[int]


class LLM:
    """Generate completions for a list of prompts with continuous batching.

    `model` is "smollm2-135m" (the default), a Hugging Face model directory, a
    .gguf file, or "dummy:<name>" (random weights at a real model's shapes, e.g.
    "dummy:llama-3.1-8b"). `device="cuda"` runs it on a GPU (bfloat16 by default).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        num_threads: int | None = None,
        loaded_model: LoadedModel | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """Load the model and build an engine for it.

        An entry point: it configures this process (`engine.envs.configure_process`,
        with torch's thread count if `num_threads` is given) before the model loads.
        `engine_kwargs` are the fields of EngineConfig (device, dtype, max_model_len,
        attention_backend, seed), CacheConfig (block_size, num_kv_blocks,
        kv_cache_memory_bytes, num_swap_blocks, swap_space_bytes,
        gpu_memory_utilization, enable_prefix_caching: on by default) and
        SchedulerConfig (max_num_seqs, max_num_batched_tokens, preemption_mode,
        priority_aging_steps, admission_reserve_steps, long_prefill_token_threshold,
        and `scheduler_policy` for its policy), with their defaults and meaning
        there (see `engine.config.engine_config`). `loaded_model` skips loading.
        """
        configure_process(num_threads)
        self.engine = LLMEngine(engine_config(model, **engine_kwargs), loaded_model)

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
        A prompt asked n > 1 gives n results in a row (`index` 0..n-1): its choice 0
        runs first, the others join once its prompt is prefilled, from the prefix
        cache; a seeded one's choice i draws from seed + i.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _per_prompt(sampling_params, SamplingParams(), len(prompt_list), "sampling params")
        priorities = _per_prompt(priority, 0, len(prompt_list), "priorities")
        requests = []  # (prompt position, choice index, request)
        try:
            prompt_logprobs = self._run(prompt_list, params_list, priorities, requests)
        except BaseException:
            for _, _, request in requests:
                self.engine.abort_request(request.request_id)
            raise
        requests.sort(key=lambda item: item[:2])
        return [
            CompletionOutput(
                request_id=request.request_id,
                prompt=prompt_list[position] if isinstance(prompt_list[position], str) else None,
                prompt_token_ids=request.prompt_token_ids,
                token_ids=request.output_token_ids,
                text=self.engine.output_text(request) or "",
                finish_reason=request.finish_reason,
                logprobs=request.logprobs,
                queue_time=request.queue_time,
                num_preemptions=request.num_preemptions,
                num_cached_tokens=request.num_cached_tokens or 0,
                num_host_cached_tokens=request.num_host_cached_tokens,
                index=index,
                prompt_logprobs=prompt_logprobs.get(request.request_id),
            )
            for position, index, request in requests
        ]

    def _run(self, prompt_list: list[Prompt], params_list: list[SamplingParams], priorities: list[int],
             requests: list) -> dict[str, list]:
        """Step the engine until every request (appended to `requests` as it is added) has
        finished; each one's prompt logprobs, by request id."""
        engine = self.engine
        followers = {}  # choice 0's request id: (prompt position, params, priority) of the others
        for position, (prompt, params, prio) in enumerate(zip(prompt_list, params_list, priorities)):
            request = engine.add_request(prompt, params.choice(0), priority=prio)
            requests.append((position, 0, request))
            if params.n > 1:
                followers[request.request_id] = (position, params, prio)
        pending = {request.request_id for _, _, request in requests}
        prompt_logprobs = {}
        while pending:
            for output in engine.step().outputs:
                if output.prompt_logprobs is not None:
                    prompt_logprobs[output.request_id] = output.prompt_logprobs
                follow = followers.pop(output.request_id, None)
                if follow is not None:  # its first token: the prompt is in the prefix cache
                    position, params, prio = follow
                    for index in range(1, params.n):
                        request = engine.add_request(prompt_list[position], params.choice(index), priority=prio)
                        requests.append((position, index, request))
                        pending.add(request.request_id)
                if output.finished:
                    pending.discard(output.request_id)
        return prompt_logprobs

    def get_metrics(self) -> SchedulerStats:
        """Scheduler counters: queues, KV blocks, preemptions, tokens per step, queue times."""
        return self.engine.get_metrics()


def _per_prompt(given, default, num_prompts: int, what: str) -> list:
    """One value for each prompt: `default` for all if `given` is None, `given` for all if
    it is one value (of default's type), else `given` (ValueError unless one per prompt)."""
    if given is None or isinstance(given, type(default)):
        return [default if given is None else given] * num_prompts
    given = list(given)
    if len(given) != num_prompts:
        raise ValueError(f"{len(given)} {what} for {num_prompts} prompts")
    return given


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
