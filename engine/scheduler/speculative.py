"""Speculative decoding in the scheduler: a decoding row's proposals (engine/spec_decode)
join its step as extra query tokens, and after the step its table rolls back to the
tokens accepted.

A row with proposals d_1..d_k runs its last token and d_1..d_k as k+1 decode entries
(engine/runner/forward_batch.py `decode_rows`): k+1 tokens of the step's budget and k+1 KV slots. The slots' KV is computed for every
proposal, but holds only for those the model accepts; so the proposals count as computed
only once accepted (`settle_proposals`), the prefix cache never sees a rejected one (it
caches computed tokens only), and the blocks past the accepted tokens go back to the pool.
Proposals never preempt: a row whose table cannot grow by them runs its one token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv.manager import cdiv
from engine.request import Request

if TYPE_CHECKING:
    from engine.kv.manager import KVCacheManager
    from engine.scheduler.output import SchedulerOutput
    from engine.scheduler.prefix import PrefixMatcher


def schedule_proposals(kv: KVCacheManager, out: SchedulerOutput, request: Request, spare_budget: int,
                       max_model_len: int) -> int:
    """Schedule as many of a decoding row's proposals as `spare_budget` (tokens the
    budget holds beyond one for each row still to schedule), max_model_len and the free
    blocks allow; recorded in `out.spec_token_ids`. Returns how many."""
    start = request.num_computed_tokens
    num_spec = min(len(request.spec_token_ids), spare_budget, max_model_len - start - 1)
    if num_spec <= 0 or not kv.allocate_slots(request.request_id, start + 1 + num_spec):
        return 0
    out.spec_token_ids[request.request_id] = request.spec_token_ids[:num_spec]
    return num_spec


def settle_proposals(prefix: PrefixMatcher, kv: KVCacheManager, request: Request, num_accepted: int) -> None:
    """After a row checked its proposals and goes on: the accepted ones are computed
    (their KV holds), and its table drops the blocks past its tokens (the rejected
    proposals' slots; the next step's token has its slot in the blocks kept)."""
    request.num_computed_tokens += num_accepted
    prefix.cache_computed(request)
    kv.truncate(request.request_id, cdiv(len(request.all_token_ids), kv.block_size))
