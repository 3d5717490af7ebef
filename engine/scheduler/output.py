"""SchedulerOutput: the work of one step, as the scheduler hands it to the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import PreemptionKind
from engine.kv.block_pool import BlockCopy
from engine.kv.host_tier import TierHolds
from engine.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    """What to run in one step.

    `requests[i]` gets `num_scheduled_tokens[i]` tokens of work, starting at its
    `num_computed_tokens` (a row in `spec_token_ids`: its last token and its proposals,
    whose KV holds only as far as they are accepted). The runner runs `swap_out` copies, then `swap_in`
    copies, then the forward pass (freed blocks may be reused in the same step).
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    swap_out: list[BlockCopy] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)
    preempted: list[tuple[Request, PreemptionKind]] = field(default_factory=list)
    # Speculative decoding: the decoding rows that check proposals this step, and those
    # proposals (the row's tokens are its last token, then these; each is sampled).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests admitted this step whose prompt KV must now be received into their blocks.
    kv_receives: list[Request] = field(default_factory=list)
    # The prefix cache's host tier (engine/kv/host_tier.py): device blocks written through to
    # host blocks, host blocks reloaded into device blocks (run after the swaps, in this
    # order), and the blocks they hold until the step has ended (release_tier_holds).
    offload: list[BlockCopy] = field(default_factory=list)
    reload: list[BlockCopy] = field(default_factory=list)
    tier_holds: TierHolds | None = None

    @property
    def has_swaps(self) -> bool:
        """Whether the step swaps blocks (a whole request's table, not the host tier's few
        blocks a step): on CUDA the step-time model does not learn from such a step."""
        return bool(self.swap_out or self.swap_in)
