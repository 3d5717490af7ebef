"""Which of a row's proposed tokens the target model accepts, so that the tokens emitted
are distributed exactly as the target alone would sample them (Leviathan et al., 2023;
Chen et al., 2023), and for greedy rows are exactly its argmax.

A row proposes k tokens d_1..d_k. The target's one forward pass over the row's last
token and the proposals gives k+1 distributions p_1..p_{k+1} (p_i: the token after d_{i-1}).
Proposal i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), q_i being the
proposer's distribution (a point mass at d_i for prompt lookup: then p_i(d_i)). At the
first rejection the row emits one token from the residual, max(p_i - q_i, 0) normalised,
and stops; if all k are accepted it emits a bonus token from p_{k+1}. Either way a row
emits between 1 and k+1 tokens, and its first token is distributed as p_1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Accepted:
    """One row's outcome: `token_ids`, the tokens it emits (its accepted proposals, then
    one from the target); `num_accepted`, how many proposals those include."""

    token_ids: list[int]
    num_accepted: int


def accept_agreeing(proposed: Sequence[int], target_tokens: Sequence[int]) -> Accepted:
    """Proposals accepted while they equal the target's own tokens, then the target's next
    token. The target's tokens are its argmax (greedy), or its samples: for point-mass
    proposals that is rejection sampling above, p_i(d_i) to keep d_i and the residual on a
    miss (engine/spec_decode/speculator.py). `proposed`: [k]; `target_tokens`: [k+1]."""
    num_accepted = next((i for i, (d, t) in enumerate(zip(proposed, target_tokens)) if d != t), len(proposed))
    return Accepted(list(target_tokens[:num_accepted + 1]), num_accepted)


def accept_sampled(proposed: Tensor, target_probs: Tensor, generator: torch.Generator | None = None,
                   draft_probs: Tensor | None = None) -> Accepted:
    """Rejection sampling. `proposed`: [k] token ids; `target_probs`: [k+1, V], the target's
    distributions after its own temperature, top-k/top-p and penalties; `draft_probs`:
    [k, V], the proposer's (None: a point mass at each proposal, as prompt lookup has).
    `generator`: the row's own (a seeded request draws the same numbers every run)."""
    k = proposed.numel()
    rows = torch.arange(k, device=target_probs.device)
    p = target_probs[:k].gather(1, proposed.view(k, 1)).squeeze(1) if k else target_probs.new_zeros(0)
    q = torch.ones_like(p) if draft_probs is None else draft_probs[rows, proposed]
    uniform = torch.rand(k, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    # u < p/q, written u * q < p: no division by a zero q (a proposal the draft could not make).
    accepted = (uniform * q < p).to(torch.int64)
    num_accepted = int(accepted.cumprod(0).sum()) if k else 0
    if num_accepted == k:
        last = target_probs[k]
    else:
        i = num_accepted
        if draft_probs is None:
            residual = target_probs[i].clone()
            residual[proposed[i]] = 0.0
        else:
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
        total = residual.sum()
        # p <= q everywhere only if p == q, when a rejection cannot happen: guarded anyway.
        last = residual / total if total > 0 else target_probs[i]
    token = int(torch.multinomial(last, 1, generator=generator))
    return Accepted([*proposed[:num_accepted].tolist(), token], num_accepted)
