"""Records the engine hands back: per-step progress, whole completions, and how its
model's weights were loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import RequestTimings
    from engine.timeline import TimelineEvent


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token, from log_softmax of the raw model logits
    (before penalties, banned ids, temperature and truncation)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # top-n (token_id, logprob), descending


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one engine step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    # What ended a "stop": the EOS or stop token id sampled, or the stop string matched.
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Prompt tokens whose KV the prefix cache held when its prefill was first admitted
    # here (None: its prompt was not prefilled here, e.g. its KV was handed off to us).
    num_cached_tokens: int | None = None
    num_host_cached_tokens: int = 0  # of them, those the host tier held (engine/kv/host_tier.py)
    text: str | None = None  # the whole output text, on the finishing step when a tokenizer exists
    new_logprobs: list[TokenLogprobs] | None = None
    # On its first answer, when asked: prompt token i + 1's logprob and top alternatives
    # at entry i (the first prompt token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Set when a prefill_only request's KV is now held for a handoff: its blocks, in order.
    kv_block_ids: list[int] | None = None
    # Set on a request's last output here (finished, or held for a handoff), once.
    timings: RequestTimings | None = None
    # Set on the output of its first decode step here (its second token), once: its timings so far.
    decode_timings: RequestTimings | None = None
    # Traced requests: timeline events since the last output.
    events: list[TimelineEvent] | None = None

    @staticmethod
    def merged(outputs: list[RequestOutput]) -> RequestOutput:
        """Consecutive outputs of one request as one (RequestStream.get): tokens, logprobs
        and events in order; what is set once (prompt logprobs, cached counts, the first
        decode step's timings) from the output that set it; the rest from the last."""
        if len(outputs) == 1:
            return outputs[0]
        first, last = outputs[0], outputs[-1]

        def joined(name: str) -> list | None:
            parts = [getattr(o, name) for o in outputs if getattr(o, name) is not None]
            return [item for part in parts for item in part] if parts else None

        def once(name: str):
            return next((getattr(o, name) for o in outputs if getattr(o, name) is not None), None)

        cached = next((o for o in outputs if o.num_cached_tokens is not None), first)
        return RequestOutput(
            last.request_id, [t for o in outputs for t in o.new_token_ids], last.finished, last.finish_reason,
            last.stop_reason, last.num_prompt_tokens, last.num_output_tokens,
            num_cached_tokens=cached.num_cached_tokens, num_host_cached_tokens=cached.num_host_cached_tokens,
            text=last.text, new_logprobs=joined("new_logprobs"), prompt_logprobs=once("prompt_logprobs"),
            kv_block_ids=last.kv_block_ids, timings=once("timings"), decode_timings=once("decode_timings"),
            events=joined("events"),
        )


@dataclass(frozen=True, slots=True)
class KvReceive:
    """A request admitted with remote KV: receive its prompt's KV into these blocks,
    then call `LLMEngine.complete_kv_receive`. The first `num_reused_blocks` hold a
    cached prefix already (prefix caching): only the blocks after them are received.
    `ticket`: the request landed in blocks set aside (engine/kv/landing.py) as its call
    arrived; if its add failed they are under a fence of that name."""

    request_id: str
    block_ids: list[int]
    num_reused_blocks: int = 0
    ticket: str | None = None


@dataclass(slots=True)
class StepOutput:
    """What one engine step did."""

    outputs: list[RequestOutput] = field(default_factory=list)
    kv_receives: list[KvReceive] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    """A finished request, as `LLM.generate` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None
    queue_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_host_cached_tokens: int = 0  # of them, those its host tier held
    index: int = 0  # its choice, of a prompt asked n > 1
    prompt_logprobs: list[TokenLogprobs] | None = None  # as RequestOutput's


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What loading the weights read and how long it took."""

    format: str  # "safetensors", "gguf", "transformers" (other formats through it) or "dummy"
    source: str  # the directory or file read ("" for dummy models)
    num_files: int = 0
    num_tensors: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    @property
    def bytes_per_second(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        return (f"{format_bytes(self.num_bytes)} in {self.num_tensors} tensors from {self.num_files} {self.format} "
                f"file(s) in {self.seconds:.2f} s ({format_bytes(self.bytes_per_second)}/s)")


def format_bytes(num_bytes: float) -> str:
    """Bytes in decimal units, e.g. "1.25 GB", "310.0 MB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{num_bytes:.0f} B"
