"""LandingZone: free KV blocks an engine sets aside while it steps, for handed-off requests
to land in at once.

A request whose prompt another engine prefilled needs blocks before its KV can be
pulled, and blocks are the engine thread's to give: queued as a command, it would wait
for the step under way to end, then the pull would run during the next step, and the
request would join the batch only in the step after that. Instead, after each schedule
the engine thread sets aside free blocks and places in the batch (`refill`); the event
loop `claim`s them for a request as its Decode call arrives and pulls its KV into them
at once, while the step runs; the request's add command, run between steps, makes them
its table (LLMEngine.add_prefilled_request with `landing`). Its pull has usually ended
by then, and the request joins the very next step. Before each schedule the engine
thread takes back what nobody claimed (`drain`), so the scheduler sees every free block.

    event loop (claim)                     engine thread
    ------------------                     -------------
                                           drain -> schedule -> refill -> run the step
    claim -> add command queued, pull ->   (the step runs)
    pull done -> complete command          add: the claimed blocks become the request's
                                           complete: RUNNING, in the next schedule

Only plain free blocks are set aside (never cached ones), and none while requests wait
for blocks: handed-off requests never overtake those, nor take what the running batch
needs to grow (Scheduler.landing_room). A request that finds too few blocks set aside
is admitted as before (queued, its blocks allocated at a schedule).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_pool import cdiv

if TYPE_CHECKING:
    from engine.block_pool import KVCacheManager


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
    on the engine thread. Off (nothing set aside) until `open`."""

    def __init__(self, kv: KVCacheManager) -> None:
        self._kv = kv
        self._lock = threading.Lock()
        self._block_ids: list[int] = []
        self._places = 0
        self._tickets = itertools.count()
        self.num_tokens = 0  # how many tokens' blocks to set aside; 0: closed

    def open(self, num_tokens: int) -> None:
        """Set aside blocks for up to `num_tokens` prompt tokens from the next refill on."""
        if num_tokens <= 0:
            raise ValueError(f"a landing zone needs a positive size, got {num_tokens}")
        self.num_tokens = num_tokens

    # ------------------------------------------------------------ event loop
    def claim(self, num_tokens: int) -> Landing | None:
        """Blocks for a prompt of `num_tokens` tokens and a place in the batch, or None if
        fewer are set aside (the request is then admitted as before)."""
        num_blocks = cdiv(num_tokens, self._kv.block_size)
        with self._lock:
            if self._places < 1 or num_blocks > len(self._block_ids):
                return None
            block_ids = self._block_ids[:num_blocks]
            del self._block_ids[:num_blocks]
            self._places -= 1
            return Landing(f"landing-{next(self._tickets)}", block_ids, time.monotonic())

    # ---------------------------------------------------------- engine thread
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
            self._block_ids = block_ids
            self._places = num_places
