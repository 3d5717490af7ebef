"""LandingZone: free KV blocks and batch places the scheduler sets aside after each
schedule, for handed-off requests to claim on the event loop as their Decode call arrives
(under a lock: no command, no wait for the step in progress), so their KV is pulled while
the step runs and they join the next one. docs/scheduler.md ("Landing") has the rules.

    event loop                              engine thread (Scheduler.schedule)
    ----------                              ----------------------------------
                                            drain -> schedule -> refill; the step runs
    claim -> add queued, pull starts        (the step runs)
    pull ends -> completion queued          add: land (its table) or refuse (fenced);
                                            completion: RUNNING, in the next schedule
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv.manager import cdiv

if TYPE_CHECKING:
    from engine.kv.manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class Landing:
    """Blocks claimed for one request at `claimed_at` (time.monotonic(): its admission).
    `ticket` names them until its add command takes them: a fence of that name holds
    them if the add fails."""

    ticket: str
    block_ids: list[int]
    claimed_at: float


class LandingZone:
    """The blocks and batch places set aside; `claim` is called on the event loop, the rest
    on the engine thread (by the Scheduler). Closed (nothing set aside) until `open`."""

    def __init__(self, kv: KVCacheManager) -> None:
        self._kv = kv
        self._lock = threading.Lock()
        self._block_ids: list[int] = []
        self._places = 0
        self._tickets = itertools.count()
        self.num_tokens = 0  # how many tokens' blocks to set aside; 0: closed
        # Claims whose add has not run yet: the Scheduler counts them as sequences.
        self.num_claimed = 0

    def open(self, num_tokens: int) -> None:
        """Set aside blocks for up to `num_tokens` prompt tokens from the next schedule on."""
        if num_tokens <= 0:
            raise ValueError(f"a landing zone needs a positive size, got {num_tokens}")
        self.num_tokens = num_tokens

    # ------------------------------------------------------------ event loop
    def claim(self, num_tokens: int) -> Landing | None:
        """Blocks for a prompt of `num_tokens` tokens and a place in the batch, or None if
        fewer are set aside (the request is then admitted as before). The caller queues
        the request's add at once, which `land`s or `refuse`s them."""
        num_blocks = cdiv(num_tokens, self._kv.block_size)
        with self._lock:
            if self._places < 1 or num_blocks > len(self._block_ids):
                return None
            block_ids = self._block_ids[:num_blocks]
            del self._block_ids[:num_blocks]
            self._places -= 1
            self.num_claimed += 1
        return Landing(f"landing-{next(self._tickets)}", block_ids, time.monotonic())

    # ---------------------------------------------------------- engine thread
    def land(self, landing: Landing, request_id: str) -> None:
        """The claimed blocks become the table of the request the add made."""
        self._kv.take_aside(landing.block_ids, to_request=request_id)
        self._settle()

    def refuse(self, landing: Landing) -> None:
        """The add was refused: the claimed blocks go under a fence named by the ticket, for
        the caller to release once its pull no longer writes into them."""
        self._kv.take_aside(landing.block_ids, to_fence=landing.ticket)
        self._settle()

    def _settle(self) -> None:
        with self._lock:
            self.num_claimed -= 1

    def drain(self) -> None:
        """Take back the blocks nobody claimed (before a schedule)."""
        with self._lock:
            block_ids, self._block_ids = self._block_ids, []
            self._places = 0
        if block_ids:
            self._kv.take_aside(block_ids)

    def refill(self, num_free: int, num_places: int) -> None:
        """Set aside up to `num_free` free blocks (at most the zone's size) and `num_places`
        places in the batch (after a schedule)."""
        if not self.num_tokens or num_free <= 0 or num_places <= 0:
            return
        block_ids = self._kv.set_aside(min(num_free, cdiv(self.num_tokens, self._kv.block_size)))
        with self._lock:
            self._block_ids.extend(block_ids)
            self._places = num_places
