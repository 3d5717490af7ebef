"""Choosing how to preempt a sequence: recompute its KV later, or swap it to CPU."""

from __future__ import annotations

from engine.config import PreemptionKind


class PreemptionCostModel:
    """Estimates both costs of preempting one sequence, from measured rates.

    - recompute ~ prefill time of the tokens whose KV is dropped
      (`num_tokens * prefill_seconds_per_token`), but for those the prefix cache
      keeps for the readmission: blocks another request holds too, or the host
      tier has (those cost a copy back each);
    - swap ~ bytes moved out now and back in later
      (`2 * num_blocks * bytes_per_block / swap_bytes_per_second`).

    The engine feeds both rates back as it measures them (exponential moving
    averages), so the choice follows the hardware: on a GPU, swapping a long
    sequence over PCIe beats re-running its prefill; a short one is cheaper to
    recompute. The prefill rate is also the step-time model's (engine/runner/step_time.py).
    """

    def __init__(
        self,
        bytes_per_block: int,
        prefill_seconds_per_token: float = 2e-4,
        swap_bytes_per_second: float = 4e9,
        smoothing: float = 0.2,
    ) -> None:
        self.bytes_per_block = bytes_per_block
        self.prefill_seconds_per_token = prefill_seconds_per_token
        self.swap_bytes_per_second = swap_bytes_per_second
        self._smoothing = smoothing
        self.num_prefill_observations = 0  # until the first, the rate is the default guess

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_seconds_per_token

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block / self.swap_bytes_per_second

    def choose(self, num_computed_tokens: int, num_blocks: int, kept: tuple[int, int] = (0, 0),
               block_size: int = 1) -> PreemptionKind:
        """`kept`: the leading blocks of its table the prefix cache keeps for its readmission,
        and how many of them it copies back (KVCacheManager.num_kept_blocks): a recompute does
        not redo their tokens, and a copy back is half a swap's round trip."""
        num_kept, num_copied = kept
        num_lost = max(num_computed_tokens - num_kept * block_size, 0)
        recompute = self.recompute_seconds(num_lost) + self.swap_seconds(num_copied) / 2
        if self.swap_seconds(num_blocks) < recompute:
            return PreemptionKind.SWAP
        return PreemptionKind.RECOMPUTE

    @property
    def measured_prefill_seconds_per_token(self) -> float:
        """The prefill rate as measured; 0.0 before any measurement."""
        return self.prefill_seconds_per_token if self.num_prefill_observations else 0.0

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            rate = seconds / num_tokens
            # The first measurement replaces the default guess outright.
            smoothing = self._smoothing if self.num_prefill_observations else 1.0
            self.prefill_seconds_per_token += smoothing * (rate - self.prefill_seconds_per_token)
            self.num_prefill_observations += 1

    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            rate = num_bytes / seconds
            self.swap_bytes_per_second += self._smoothing * (rate - self.swap_bytes_per_second)
