"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the
tokens before it, and the top-k alternatives at its position, computed during prefill,
chunk by chunk, from the hidden states the forward pass already has.

A request that asks keeps `Request.prompt_logprobs`, the entries so far (entry i is prompt
token i + 1's: the first token has none), until its first answer takes them. Such a
request does not read the prefix cache (PrefixMatcher.hit): every position is computed,
so every entry comes from this engine's forward pass. A recompute after a preemption
skips what it already has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprobs
from engine.request import Request

# Prompt positions whose full-vocabulary logits exist at once (a long chunk's would be
# gigabytes at a 150k vocabulary).
ROWS_AT_ONCE = 256


@dataclass(frozen=True, slots=True)
class PromptRows:
    """A prefill chunk's rows whose logits give prompt logprobs: `count` rows of the
    step's batch from `row`, the targets prompt tokens `first_target`, first_target + 1, ..."""

    request: Request
    row: int
    first_target: int
    count: int


def wants_rows(request: Request) -> bool:
    """Whether a request's next position still predicts a prompt token it needs an entry
    for: its step is then a prefill chunk, even of one token (not a decode row)."""
    return request.prompt_logprobs is not None and request.num_computed_tokens < request.num_prompt_tokens - 1


def prompt_rows(request: Request, row_start: int, start: int, end: int) -> PromptRows | None:
    """The rows of a chunk of positions [start, end) starting at batch row `row_start`
    whose logits predict prompt tokens this request still needs entries for."""
    if request.prompt_logprobs is None:
        return None
    first = max(start + 1, len(request.prompt_logprobs) + 1)  # target positions, 1-based in the prompt
    last = min(end, request.num_prompt_tokens - 1)
    if first > last:
        return None
    return PromptRows(request, row_start + (first - 1 - start), first, last - first + 1)


class PendingPromptLogprobs:
    """One step's prompt logprobs on the device, their copy to the host under way (on CUDA
    into pinned memory, before the step's tokens: the step's one wait covers it)."""

    def __init__(self, chunks: list[PromptRows], tensors: tuple[torch.Tensor, ...]) -> None:
        self.chunks = chunks
        self.tensors = tensors

    @classmethod
    def launch(cls, model, hidden: torch.Tensor, chunks: list[PromptRows]) -> PendingPromptLogprobs:
        device = hidden.device
        pinned = device.type == "cuda"
        rows = torch.tensor([c.row + i for c in chunks for i in range(c.count)], pin_memory=pinned)
        targets = torch.tensor([c.request.prompt_token_ids[c.first_target + i] for c in chunks for i in range(c.count)],
                               pin_memory=pinned)
        rows, targets = rows.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        k = max(1, max(c.request.sampling_params.prompt_logprobs for c in chunks))
        parts = []
        for at in range(0, len(rows), ROWS_AT_ONCE):  # [R, V] logits a slice at a time
            logits = model.compute_logits(hidden.index_select(0, rows[at: at + ROWS_AT_ONCE]))
            logprobs = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32).log_softmax(-1)
            top_vals, top_ids = logprobs.topk(k, dim=-1)
            parts.append((logprobs.gather(1, targets[at: at + ROWS_AT_ONCE, None])[:, 0], top_vals, top_ids))
        values = tuple(torch.cat(column) for column in zip(*parts))
        if pinned:
            values = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                           for t in values)
        return cls(chunks, values)

    def result(self) -> list[tuple[PromptRows, list[TokenLogprobs]]]:
        """Each chunk's entries (read once the step's tokens are: the copies are done)."""
        target, top_vals, top_ids = (t.tolist() for t in self.tensors)
        out, at = [], 0
        for chunk in self.chunks:
            k = chunk.request.sampling_params.prompt_logprobs
            prompt = chunk.request.prompt_token_ids
            entries = [TokenLogprobs(prompt[chunk.first_target + i], target[at + i],
                                     tuple(zip(top_ids[at + i][:k], top_vals[at + i][:k])))
                       for i in range(chunk.count)]
            out.append((chunk, entries))
            at += chunk.count
        return out


def record(results: list[tuple[PromptRows, list[TokenLogprobs]]]) -> None:
    """Put a step's entries on their requests (in order: a chunk's follow the last's)."""
    for chunk, entries in results:
        have = chunk.request.prompt_logprobs
        if have is not None and len(have) == chunk.first_target - 1:
            have.extend(entries)


def take(request: Request) -> list[TokenLogprobs] | None:
    """A request's prompt logprobs, for its first answer (None after: taken once)."""
    entries = request.prompt_logprobs
    if entries is None:
        return None
    request.prompt_logprobs = None
    return entries
