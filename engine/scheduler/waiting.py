"""WaitingQueue: requests waiting for admission, in order of priority with aging."""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from engine.request import Request


class WaitingQueue:
    """A heap of waiting requests, best first.

    Aging makes a request's effective priority `priority - waited_steps /
    aging_steps`, so a low-priority request overtakes newer high-priority ones
    after waiting long enough and cannot starve. Ordering by
    `priority * aging_steps + arrival_step` is that same order at every step, so
    the keys never need updating. Ties go to the earlier arrival.
    """

    __slots__ = ("_heap", "_aging_steps")

    def __init__(self, aging_steps: int) -> None:
        self._heap: list[tuple[int, int, Request]] = []  # (aging key, arrival index, request)
        self._aging_steps = aging_steps

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In heap order, not admission order."""
        return (entry[2] for entry in self._heap)

    def push(self, request: Request) -> None:
        """Queue a request by its arrival (a requeued request keeps its original place)."""
        key = request.priority * self._aging_steps + request.arrival_step
        heapq.heappush(self._heap, (key, request.arrival_index, request))

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)
