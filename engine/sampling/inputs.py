"""What the sampler needs from a step's requests, read on the host: the rows' histories
and the ids they may not sample this step (SamplingBatch.build's inputs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import PENDING_TOKEN, Request
from engine.sampling.batch import PENDING_OUTPUT, SamplingBatch


def sampling_batch(requests: Sequence[Request], device: torch.device) -> SamplingBatch:
    params = [r.sampling_params for r in requests]
    generators = [r.generator for r in requests]
    histories = None
    if any(p.repetition_penalty != 1.0 for p in params):
        histories = [r.all_token_ids for r in requests]
    outputs = None
    if any(p.has_output_penalty for p in params):
        outputs = [_output_history(r) if r.sampling_params.has_output_penalty else () for r in requests]
    banned = conditions = None
    if any(p.min_tokens for p in params) or any(r.bad_word_ids for r in requests):
        bans = [_bans(r) for r in requests]
        banned = [ids for ids, _ in bans]
        conditions = [conds for _, conds in bans]
    return SamplingBatch.build(params, generators, histories, banned_token_ids=banned, device=device,
                               output_histories=outputs, ban_conditions=conditions)


def _output_history(request: Request) -> list[int]:
    generated = request.generated_token_ids
    if generated and generated[-1] == PENDING_TOKEN:
        generated[-1] = PENDING_OUTPUT
    return generated


def _bans(request: Request) -> tuple[list[int], list[int]]:
    """The ids `request` may not sample next, each with its condition: -1 (always), or
    the token that must be its last (still on the device when overlapped)."""
    params = request.sampling_params
    ids: list[int] = []
    # A grammar decides when its output may end: banning EOS where it allows nothing else
    # would leave the row no token at all.
    if request.num_output_tokens < params.min_tokens and request.grammar is None:
        ids += request.eos_token_ids
        ids += params.stop_token_ids
    conditions = [-1] * len(ids)
    if request.bad_word_ids:
        extra_ids, extra_conditions = bad_word_bans(request.bad_word_ids, request.generated_token_ids)
        ids += extra_ids
        conditions += extra_conditions
    return ids, conditions


def bad_word_bans(bad_words: Sequence[Sequence[int]], generated: Sequence[int]) -> tuple[list[int], list[int]]:
    """vLLM's bad words: a word's last token is banned where the generated tokens end with
    the rest of it (a one-token word: always). With the last generated token PENDING_TOKEN,
    a word whose rest ends the known tokens but for its last is banned on the condition
    that the pending token is that last one."""
    pending = bool(generated) and generated[-1] == PENDING_TOKEN
    known = list(generated[:-1]) if pending else list(generated)
    ids, conditions = [], []
    for word in bad_words:
        prefix, banned = list(word[:-1]), word[-1]
        if not prefix:
            ids.append(banned)
            conditions.append(-1)
        elif not pending:
            if known[len(known) - len(prefix):] == prefix and len(known) >= len(prefix):
                ids.append(banned)
                conditions.append(-1)
        elif len(known) >= len(prefix) - 1 and (len(prefix) == 1
                                                  or known[len(known) - len(prefix) + 1:] == prefix[:-1]):
            ids.append(banned)
            conditions.append(prefix[-1])
    return ids, conditions
