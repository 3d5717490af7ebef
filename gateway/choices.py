"""A request's n > 1 choices: each one a request of its own to the workers, the prompt
prefilled once.

Choice 0 goes first; the others follow once its second delta is out (or it ended), so
that its prompt's blocks are in the prefix caches by then: the prefill worker (prefix
affinity routes them to it) computes only the prompt's last, partial block for each, and
the decode worker (routed to by the same affinity) already holds the full blocks, so
their handoffs move only that partial block. (The first delta comes from the prefill
worker before the handoff: the decode worker may not hold the blocks yet. The second
comes from the decode worker, which decoded from them.) Each choice is an ordinary request from then on: its own stop
strings, its own move to another decode worker if its worker is lost; a seeded request's
choice i draws from seed + i (SamplingParams.choice). The stream interleaves the
choices' deltas, each tagged with its index; the stream's last delta has the usage (the
prompt counted once, every choice's tokens), the other choices' last deltas none.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from baton.wire.records import TextDelta
from gateway.prepare import PreparedRequest

# What a choice's outcome says about the request, worst first.
_FAILED = ("error", "deadline", "abort")


def choice_requests(prepared: PreparedRequest) -> list[PreparedRequest]:
    """The request's choices as requests of their own: their ids `<id>#<index>` among the
    workers, each its own KV token."""
    worker_id = prepared.worker_request_id or prepared.request_id
    return [replace(prepared, params=prepared.params.choice(index), worker_request_id=f"{worker_id}#{index}",
                    kv_token=secrets.token_hex(16), outcome=None)
            for index in range(prepared.params.n)]


# A usage's counts of cached prompt tokens (TextDelta's), all and by tier.
_CACHED = ("num_cached_tokens", "num_host_cached_tokens")


async def merged_choices(prepared: PreparedRequest, stream: Callable[[PreparedRequest, int], AsyncIterator[TextDelta]]
                         ) -> AsyncIterator[TextDelta]:
    """The deltas of every choice of `prepared` (`stream(choice, index)` runs one), as they
    come; the first error ends them all. Sets `prepared.outcome` from the choices'."""
    choices = choice_requests(prepared)
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int) -> None:
        try:
            async for delta in stream(choices[index], index):
                await queue.put(delta)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            await queue.put(error)
            return
        await queue.put(done)

    tasks = [asyncio.ensure_future(pump(0))]
    remaining = len(choices)
    num_finished = num_completion = num_first = 0
    cached = dict.fromkeys(_CACHED, 0)  # choice 0's counts: its prompt's, reported once
    try:
        while remaining:
            item = await queue.get()
            if len(tasks) == 1 and not isinstance(item, BaseException):
                num_first += 1
                if num_first == 2 or item is done or item.finish_reason is not None:
                    # choice 0's second delta (or its end): its prompt is cached everywhere now
                    tasks += [asyncio.ensure_future(pump(index)) for index in range(1, len(choices))]
            if item is done:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None:
                num_finished += 1
                num_completion += item.num_completion_tokens
                if item.index == 0:
                    cached = {name: getattr(item, name) for name in _CACHED}
                if num_finished < len(choices):  # others still run: the usage comes with the last
                    item = replace(item, num_prompt_tokens=0, num_completion_tokens=0, **dict.fromkeys(_CACHED, 0))
                else:
                    item = replace(item, num_completion_tokens=num_completion, **cached)
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        outcomes = [choice.outcome for choice in choices]
        prepared.outcome = next((o for failed in _FAILED for o in outcomes if o == failed), outcomes[0])
