"""Cold-start burst: what a fresh deployment does with a burst it has never seen.

Users hit new replicas, restarts and scale-ups with bursts, before the deployment has
measured itself under load. For each case a deployment is started and, with nothing sent
before, --burst calls go out at once through --clients concurrent callers (64-token
prompts, 400 tokens each with ignore_eos, a --deadline gRPC deadline, no retries: the
shape of issue 51's outside probe). Then, on the same deployment now warm, the closed-loop
capacity of that shape within the deadline is measured, and the burst's goodput is
reported beside it:

    one-thread       gateway + 1 prefill + 1 decode worker, one thread each
    two-decode       gateway + 1 prefill + 2 decode workers, one thread each
    one-lost         two-decode with one decode worker killed 2 s before the burst
                     (the gateway has marked it down)

Per case: completed within the deadline, admitted then ended by it (or shed by the
gateway when it fell behind: DEADLINE_EXCEEDED after tokens, or after being admitted),
refused (RESOURCE_EXHAUSTED, or DEADLINE_EXCEEDED before its deadline with no token, but
for a shedding: that one was admitted), the slowest refusal, and
goodput (completed within the deadline per second of the burst's span, at least the
deadline) over the warm capacity.

Targets (issue 51): goodput >= 0.8x the warm capacity, admitted-then-late <= 10% of
admitted, and every refusal within 1 s of its call where the client has a core of its
own; where it has not (fewer cores than the deployment's processes and the client), a
refusal is read against what the machine does to any call then: a do-nothing gRPC server
in a process of its own (the health service alone) is called every PING_INTERVAL_S from
the client's loop through the burst, and every refusal must come within 2x that call's
p99 (or 1 s, whichever is longer).

    python -m benchmarks.cold_burst --out cold.json
    python -m benchmarks.cold_burst --quick          # one case, a burst of 400
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks import goodput
from benchmarks.load import Client, Outcome

CASES = ("one-thread", "two-decode", "one-lost")
GOODPUT_TARGET = 0.8
LATE_TARGET = 0.10
REFUSAL_TARGET_S = 1.0
PING_INTERVAL_S = 0.05
# A do-nothing gRPC server: the health service alone, on a free port it prints.
_DO_NOTHING_SERVER = """
import asyncio, grpc
from grpc_health.v1 import health, health_pb2_grpc
async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()
asyncio.run(main())
"""


@contextlib.contextmanager
def do_nothing_server():
    """A do-nothing gRPC server in a process of its own; yields its address."""
    process = subprocess.Popen([sys.executable, "-c", _DO_NOTHING_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        yield f"127.0.0.1:{int(process.stdout.readline())}"
    finally:
        process.kill()
        process.wait()


async def ping(address: str, stop: asyncio.Event) -> list[float]:
    """Seconds each call to the do-nothing server at `address` took, one every
    PING_INTERVAL_S from this loop until `stop`."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    seconds = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)  # connected before the burst
        while not stop.is_set():
            sent = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=60)
            seconds.append(time.perf_counter() - sent)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PING_INTERVAL_S)
    return seconds


async def cold_burst(client: Client, requests, clients: int, deadline_s: float) -> list[Outcome]:
    """Every request once, through `clients` concurrent callers, each with a gRPC deadline
    `deadline_s` from its call; no retries."""
    base = time.perf_counter()
    callers = asyncio.Semaphore(clients)

    async def one(request) -> Outcome:
        async with callers:
            return await client.once(request, base, deadline_s)

    return await asyncio.gather(*(one(r) for r in requests))


def figures(outcomes: list[Outcome], deadline_s: float, capacity_per_s: float, pings: list[float] = (),
            own_core: bool = True) -> dict:
    in_time = [o for o in outcomes if o.is_within_deadline]
    refused = [o for o in outcomes if o.is_refused]  # never admitted
    late = [o for o in outcomes if not o.is_refused and not o.is_within_deadline]
    admitted = len(in_time) + len(late)
    # Over the burst's span: its callers start later calls as earlier ones end.
    span_s = max(deadline_s, max((o.finished for o in outcomes), default=0.0))
    goodput_per_s = len(in_time) / span_s
    return {
        "completed_in_time": len(in_time), "admitted_then_late": len(late), "refused": len(refused),
        "admitted": admitted, "late_share": len(late) / admitted if admitted else 0.0,
        "slowest_refusal_s": max((o.finished - o.sent for o in refused), default=0.0),
        "refusal_p99_s": float(np.percentile([o.finished - o.sent for o in refused], 99)) if refused else 0.0,
        # When the slowest was sent, seconds into the burst: in its first wave, or later.
        "slowest_refusal_sent_s": max(refused, key=lambda o: o.finished - o.sent).sent if refused else 0.0,
        # The refusals slower than REFUSAL_TARGET_S, by what they said (numbers left out).
        "slow_refusals": dict(Counter(re.sub(r"[0-9.]+", "#", o.message)[:100] for o in refused
                                      if o.finished - o.sent > REFUSAL_TARGET_S)),
        "statuses": {s: sum(o.status == s for o in outcomes) for s in sorted({o.status for o in outcomes})},
        "goodput_per_s": goodput_per_s, "warm_capacity_per_s": capacity_per_s,
        "goodput_ratio": goodput_per_s / capacity_per_s if capacity_per_s else 0.0,
        "last_completion_s": max((o.finished for o in in_time), default=0.0),
        "client_has_own_core": own_core,
        "do_nothing_p99_s": float(np.percentile(pings, 99)) if len(pings) else None,
        "refusal_target_s": refusal_target_s(own_core, pings),
    }


def refusal_target_s(own_core: bool, pings) -> float:
    """REFUSAL_TARGET_S where the client has a core of its own, else 2x the do-nothing
    server's p99 in the same run (if longer)."""
    if own_core or not len(pings):
        return REFUSAL_TARGET_S
    return max(REFUSAL_TARGET_S, 2 * float(np.percentile(pings, 99)))


async def measure(args, deployment, requests, lose: bool) -> dict:
    client = Client(deployment.gateway)
    try:
        if lose:
            victim = deployment.workers("decode")[-1]
            victim.popen.kill()
            victim.popen.wait()
            deployment.processes.remove(victim)  # gone: not waited for, not stopped
            await asyncio.sleep(2.0)
        print(f"  burst of {len(requests)} ...", file=sys.stderr, flush=True)
        with do_nothing_server() as address:
            stop = asyncio.Event()
            pinger = asyncio.create_task(ping(address, stop))
            # The gateway's own health service, the same way: what any call waits there.
            gateway_pinger = asyncio.create_task(ping(deployment.gateway, stop))
            outcomes = await cold_burst(client, requests, args.clients, args.deadline)
            stop.set()
            pings, gateway_pings = await pinger, await gateway_pinger
        await asyncio.to_thread(deployment.wait_idle, 120)
        concurrency = sum(deployment.stats(p).max_num_seqs for p in deployment.workers("decode"))
        print("  warm capacity of its shape ...", file=sys.stderr, flush=True)
        cap = await goodput.capacity(client, requests, concurrency, max(args.capacity_seconds, args.deadline),
                                     args.deadline, args.deadline, stagger_s=args.deadline)
    finally:
        await client.close()
    # The client has a core of its own if the machine has one beyond the deployment's
    # processes (one thread each) and the do-nothing server's.
    own_core = (os.cpu_count() or 1) > len(deployment.processes) + 1
    report = figures(outcomes, args.deadline, cap["requests_per_s"], pings, own_core)
    report["gateway_health_p99_s"] = float(np.percentile(gateway_pings, 99)) if gateway_pings else None
    report["gateway_health_max_s"] = max(gateway_pings, default=None)
    return report


def run_case(args, case: str, requests) -> dict:
    from baton.cli.local import start_deployment

    num_decode = 1 if case == "one-thread" else 2
    with tempfile.TemporaryDirectory(prefix="baton-cold-") as tmp:
        deployment = start_deployment(args.model, Path(args.log_dir or tmp) / case, num_decode=num_decode,
                                      threads=1, timeout_s=900, env={"OTEL_SDK_DISABLED": "true"})
        try:
            report = asyncio.run(measure(args, deployment, requests, lose=case == "one-lost"))
        finally:
            deployment.stop()
    return report


def checks(report: dict) -> list[dict]:
    rows = []
    for case, figures_ in report["cases"].items():
        rows += [
            {"name": f"{case}: goodput / warm capacity", "value": figures_["goodput_ratio"],
             "target": GOODPUT_TARGET, "ok": figures_["goodput_ratio"] >= GOODPUT_TARGET},
            {"name": f"{case}: admitted then late", "value": figures_["late_share"], "target": LATE_TARGET,
             "ok": figures_["late_share"] <= LATE_TARGET},
            {"name": f"{case}: slowest refusal (s)", "value": figures_["slowest_refusal_s"],
             "target": figures_["refusal_target_s"],
             "ok": figures_["slowest_refusal_s"] <= figures_["refusal_target_s"]},
        ]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:tiny")
    p.add_argument("--quick", action="store_true", help="one case (one-thread), a burst of 400")
    p.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    p.add_argument("--burst", type=int, default=None, help="calls at once (default 1500, --quick 400)")
    p.add_argument("--clients", type=int, default=256, help="concurrent callers")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=400)
    p.add_argument("--deadline", type=float, default=30.0)
    p.add_argument("--capacity-seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="PATH")
    p.add_argument("--log-dir", default=None, metavar="PATH")
    args = p.parse_args(argv)
    args.burst = args.burst or (400 if args.quick else 1500)
    args.cases = tuple(args.cases.split(",")) if args.cases else (("one-thread",) if args.quick else CASES)
    unknown = set(args.cases) - set(CASES)
    if unknown:
        p.error(f"unknown case(s) {', '.join(sorted(unknown))}: use {', '.join(CASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from engine.tokenizer import load_tokenizer

    args = parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    vocab = len(tokenizer) if tokenizer is not None else 256
    requests = goodput.fixed_workload(vocab, args.burst, args.prompt_tokens, args.output_tokens, args.seed)
    report = {"args": vars(args), "cases": {}}
    for case in args.cases:
        print(f"{case}: a fresh deployment ...", file=sys.stderr, flush=True)
        report["cases"][case] = run_case(args, case, requests)
        print(f"  {json.dumps(report['cases'][case])}", file=sys.stderr, flush=True)
    report["checks"] = checks(report)
    for row in report["checks"]:
        print(f"{'ok  ' if row['ok'] else 'MISS'} {row['name']}: {row['value']:.3f} (target {row['target']})")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if all(row["ok"] for row in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
