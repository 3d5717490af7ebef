"""WaitingQueue: requests waiting for admission, by priority level (with aging), then
earliest deadline."""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from engine.request import Request, deadline_key


class WaitingQueue:
    """A heap of waiting requests, best first.

    A request's level is `priority + arrival_step // aging_steps` (lower first): aging
    by whole levels, so a request outranks every request of its priority that arrived
    `aging_steps` or more steps after it, deadline or not, and none starves. Within a level,
    earliest deadline first; requests without a deadline come after those with one, in
    arrival order. The key depends only on the request's arrival, so it never needs
    updating, and a requeued request (preempted, failed handoff) keeps its place.
    """

    __slots__ = ("_heap", "_aging_steps")

    def __init__(self, aging_steps: int) -> None:
        # (level, deadline (inf: none), arrival index, request): the index is unique,
        # so requests are never compared.
        self._heap: list[tuple[int, float, int, Request]] = []
        self._aging_steps = aging_steps

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In heap order, not admission order."""
        return (entry[3] for entry in self._heap)

    def push(self, request: Request) -> None:
        """Queue a request by its arrival (a requeued request keeps its original place)."""
        level = request.priority + request.arrival_step // self._aging_steps
        heapq.heappush(self._heap, (level, deadline_key(request.deadline), request.arrival_index, request))

    def peek(self) -> Request:
        return self._heap[0][3]

    def head_key(self) -> tuple[int, float, int]:
        """The best request's place: (level, deadline, arrival index)."""
        return self._heap[0][:3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        """Take `request` out, if it is here."""
        kept = [entry for entry in self._heap if entry[3] is not request]
        if len(kept) < len(self._heap):
            heapq.heapify(kept)
            self._heap = kept
