"""The overload benchmark's deadline phases (issue 29): what a deployment completes within
the gRPC deadlines its requests carry. benchmarks/overload.py runs them and lists the
targets; this module measures and judges.

    capacity   closed loop at the gateway's concurrency: requests completed within their
               deadline per second (any completion, with no deadline), counted after a
               warm-up; the clients may start spread out (a burst's shape all started
               at once would finish in waves that a short window counts whole or not at all)
    mixed      Poisson arrivals, each request of one deadline class in turn (5 s, 30 s,
               none by default), no retries: per class, goodput, completions and refusals
    burst      the figures of requests sent at once with a deadline each (the phase itself
               is benchmarks/overload.py's): goodput, the slowest refusal, and the admitted
               requests that missed their deadline, and by how much

Goodput counts a request that completed within its deadline; its window is the phase's
(the arrivals' for an open loop, counting completions within it; up to the last completion
for a burst). A request that missed its deadline after its first token was cut off by it,
so how much it missed by is projected: its tokens left at its own pace (benchmarks/load.py
Attempt.missed_by_s). One with neither a refusal nor a token by its deadline is counted
apart, unanswered: from the client, a refusal that came too late and an admitted request
that never started look the same.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import numpy as np

from benchmarks.load import Client, Outcome, goodput, percentile, statuses
from benchmarks.workload import BenchRequest, WorkloadConfig, make_workload

NO_DEADLINE = None


def ratio(value: float, base: float) -> float:
    return value / base if base else float("nan")


def class_name(deadline_s: float | None) -> str:
    return "none" if deadline_s is None else f"{deadline_s:g} s"


def parse_deadlines(text: str) -> tuple[float | None, ...]:
    """"5,30,none" -> (5.0, 30.0, None)."""
    return tuple(None if part.strip() == "none" else float(part) for part in text.split(",") if part.strip())


def fixed_workload(vocab_size: int, num_requests: int, prompt_tokens: int, output_tokens: int,
                   seed: int) -> list[BenchRequest]:
    """Requests of one shape: `prompt_tokens` random tokens, `output_tokens` out."""
    return make_workload(vocab_size, WorkloadConfig(
        num_requests=num_requests, min_prompt_len=prompt_tokens, max_prompt_len=prompt_tokens,
        min_output_len=output_tokens, max_output_len=output_tokens, seed=seed))


# ------------------------------------------------------------------------ phases
async def capacity(client: Client, requests: list[BenchRequest], concurrency: int, seconds: float,
                   warmup_s: float, deadline_s: float | None = NO_DEADLINE, stagger_s: float = 0.0) -> dict:
    """Closed loop, `concurrency` clients, the i-th starting at i/concurrency of `stagger_s`,
    each request with a gRPC deadline `deadline_s` away (None: none), a refused one retried
    within about a second: requests completed within their deadline per second, counted from
    `warmup_s` for `seconds`. The calls still running then are cancelled."""
    base = time.perf_counter()
    stop = base + warmup_s + seconds
    source = itertools.cycle(requests)
    outcomes: list[Outcome] = []

    async def loop(index: int) -> None:
        await asyncio.sleep(stagger_s * index / concurrency)
        while time.perf_counter() < stop:
            outcome = await client.once(next(source), base, deadline_s)
            outcomes.append(outcome)
            if outcome.is_refused:
                # Again within about a second, whatever the hint: a slot that frees is taken
                # at once, as a deployment at capacity would have it, and 64 clients polling
                # cost the gateway a few ms a second (at 0.1 s, refusals took a core).
                await asyncio.sleep(min(outcome.retry_after_s or 1.0, 1.0) * random.uniform(0.5, 1.5))
            elif outcome.status not in ("OK", "DEADLINE_EXCEEDED") or \
                    (outcome.status == "DEADLINE_EXCEEDED" and deadline_s is None):
                raise RuntimeError(f"capacity request failed: {outcome.status}")

    tasks = [asyncio.create_task(loop(i)) for i in range(concurrency)]
    try:
        done, _ = await asyncio.wait(tasks, timeout=max(0.0, stop - time.perf_counter()),
                                     return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # a failed client's error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    counted = [o for o in outcomes if warmup_s <= o.finished <= warmup_s + seconds]
    figures = goodput(counted, seconds)
    return {"requests_per_s": figures["goodput_requests_per_s"],
            "output_tokens_per_s": figures["goodput_output_tokens_per_s"], "concurrency": concurrency,
            "deadline_s": deadline_s, "statuses": statuses(counted),
            "refused": sum(1 for o in outcomes if o.is_refused),
            "missed_deadline": sum(1 for o in outcomes if o.missed_by_s is not None)}


async def mixed(client: Client, requests: list[BenchRequest], deadlines: tuple[float | None, ...], rate: float,
                seconds: float, seed: int) -> list[Outcome]:
    """Poisson arrivals at `rate` for `seconds`, the i-th request with deadline
    `deadlines[i % len(deadlines)]` (None: none); no retries. Each Outcome's deadline_s
    is its class."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=int(rate * seconds * 2) + 10)
    offsets = [t for t in np.cumsum(gaps) if t < seconds]
    base = time.perf_counter()

    async def one(request: BenchRequest, offset: float, deadline_s: float | None) -> Outcome:
        await asyncio.sleep(max(0.0, base + offset - time.perf_counter()))
        return await client.once(request, base, deadline_s)

    return await asyncio.gather(*(one(r, o, d) for r, o, d in zip(itertools.cycle(requests), offsets,
                                                                   itertools.cycle(deadlines))))


# ------------------------------------------------------------------------ figures
def deadline_figures(outcomes: list[Outcome]) -> dict:
    """Refusals (the slowest, and by status); the calls left unanswered at their deadline
    (Attempt.is_unanswered); and the started requests that missed their deadline: how many,
    and the worst by how much, in seconds and as a share of its deadline."""
    refused = [o for o in outcomes if o.refusal_seconds]
    missed = [o for o in outcomes if o.missed_by_s is not None]
    worst = max(missed, key=lambda o: o.missed_by_s / o.deadline_s, default=None)
    return {
        "slowest_refusal_ms": max((s for o in refused for s in o.refusal_seconds), default=0.0) * 1e3,
        "refused_by_status": statuses([o for o in outcomes if o.is_refused]),
        "num_unanswered": sum(1 for o in outcomes if o.is_unanswered),
        "num_missed_deadline": len(missed),
        "worst_miss_s": worst.missed_by_s if worst else 0.0,
        "worst_miss_share": worst.missed_by_s / worst.deadline_s if worst else 0.0,
    }


def mixed_figures(outcomes: list[Outcome], deadlines: tuple[float | None, ...], seconds: float,
                  cap: float) -> dict:
    """Per deadline class: its requests' statuses, completions, goodput (completions
    within the deadline and the window, per second of it) against its share of `cap`, and
    the deadline figures."""
    share = cap / len(deadlines)
    figures = {}
    for deadline_s in deadlines:
        mine = [o for o in outcomes if o.deadline_s == deadline_s]
        rates = goodput(mine, seconds, end=seconds)
        figures[class_name(deadline_s)] = {
            "deadline_s": deadline_s, "num_requests": len(mine), "statuses": statuses(mine),
            "completions": sum(1 for o in mine if o.status == "OK"), **rates,
            "goodput_over_share": ratio(rates["goodput_requests_per_s"], share),
            "ttft_p99_ms": percentile([o.ttft for o in mine if o.status == "OK"], 99) * 1e3,
            **deadline_figures(mine),
        }
    return figures


def burst_goodput(outcomes: list[Outcome], cap: float) -> dict:
    """Goodput over the burst's window (to its last completion), against `cap`."""
    served = [o for o in outcomes if o.status == "OK"]
    window = max((o.finished for o in served), default=float("nan"))
    rates = goodput(outcomes, window) if served else {"goodput_requests_per_s": 0.0,
                                                       "goodput_output_tokens_per_s": 0.0}
    return {"window_s": window, **rates, "goodput_ratio": ratio(rates["goodput_requests_per_s"], cap),
            **deadline_figures(outcomes)}
