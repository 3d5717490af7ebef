"""Chaos benchmark: how a deployment rides out the loss of its workers, over real processes.

One deployment: a gateway, a prefill worker and two decode workers (every prompt
handed off), serving `--model` (default `dummy:tiny`, random weights that step in
milliseconds: the figures are the serving system's, not the model's).

    recovery  streams run while a worker is killed (-9) or frozen (SIGSTOP): decode
              workers mid-decode, the prefill worker as prompts arrive. Each round
              checks every stream against an undisturbed run and reports the recovery
              time: the victim's loss to the moved streams' next token (the longest
              token gap after it). Target: under 3 s.
    soak      an open-loop stream of requests for `--soak-s` seconds (default 30 min),
              a fraction cancelled at random moments, and every `--restart-every-s` a
              worker stopped (SIGTERM and kill -9 in turn) and restarted. Reported: every
              request's outcome by status (an unclear one, UNKNOWN or INTERNAL, is a
              failure), the blocks still held after the run (target 0), and the RSS
              growth of each process not restarted, from after a warm-up to the end
              (target under 5%).

    python -m benchmarks.chaos --out results/chaos            # 5 rounds each, 30-minute soak
    python -m benchmarks.chaos --quick --out /tmp/chaos        # 1 round each, 60-second soak
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

from baton.cli.local import Deployment, Process, start_deployment, wait_in_rotation
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from benchmarks.load import rss_bytes, rss_or_zero

SECTIONS = ("recovery", "soak")
RECOVERY_TARGET_S = 3.0
RSS_GROWTH_TARGET = 0.05
RSS_SAMPLE_S = 30.0
CLEAR_CODES = {"OK", "CANCELLED", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
VICTIMS = (("decode", signal.SIGKILL), ("decode", signal.SIGSTOP),
           ("prefill", signal.SIGKILL), ("prefill", signal.SIGSTOP))


def deploy(args, log_dir: Path) -> Deployment:
    return start_deployment(
        args.model, log_dir, num_decode=2, threads=args.threads,
        worker_args=["--max-model-len", "1024", "--transfer-timeout-s", "3", "--lease-s", "5", "--grace-s", "1"],
        # Admission wide open: overload is benchmarks/overload.py's subject.
        gateway_args=["--max-prefill-queue-tokens", "0", "--stall-timeout-s", "1",
                      "--max-queue-wait-s", "3600", "--max-concurrent-requests", "1000"],
        env={"OTEL_SDK_DISABLED": "true"}, timeout_s=600,
    )


def request(i: int, max_tokens: int, vocab: int = 500) -> pb.GenerateRequest:
    """Request i: greedy, or (every fourth) seeded sampling; always max_tokens long."""
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if i % 4 == 3:
        sampling = pb.SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True)
    prompt = [10 + (i * 7 + j) % (vocab - 10) for j in range(40 + 3 * i)]
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


def is_idle_within(deployment: Deployment, timeout_s: float) -> bool:
    """Whether every worker gets to hold no block, request or handoff within `timeout_s`."""
    try:
        deployment.wait_idle(timeout_s)
    except TimeoutError:
        return False
    return True


# --------------------------------------------------------------------- recovery
class Streams:
    """Concurrent streams through a gateway, one a request: each one's tokens and their
    arrival times (time.monotonic()). tests/serving/test_chaos.py drives its streams with it too."""

    def __init__(self, requests: list[pb.GenerateRequest], timeout_s: float) -> None:
        self.requests = requests
        self.timeout_s = timeout_s
        self.tokens: list[list[int]] = [[] for _ in requests]
        self.times: list[list[float]] = [[] for _ in requests]

    async def run(self, gateway: str, disturb=None, when_tokens: int = 0) -> float | None:
        """Run them all; once every stream has `when_tokens` tokens (0: at once), call
        `disturb()` in a thread. Returns what it returns (when it struck, time.monotonic())."""
        async with grpc.aio.insecure_channel(gateway) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(i: int) -> None:
                async for message in stub.GenerateStream(self.requests[i], timeout=self.timeout_s):
                    self.tokens[i].extend(message.token_ids)
                    self.times[i].extend([time.monotonic()] * len(message.token_ids))

            streams = asyncio.gather(*(one(i) for i in range(len(self.requests))))
            struck = None
            if disturb is not None:
                while min(len(t) for t in self.tokens) < when_tokens:
                    if streams.done():
                        await streams  # a stream's error, where one failed
                        raise RuntimeError("the streams ended before the disturbance")
                    await asyncio.sleep(0.005)
                struck = await asyncio.to_thread(disturb)
            await streams
            return struck

    def longest_gap_after(self, since: float) -> float:
        """The longest wait for a token after `since` (a victim's loss): from `since` to a
        stream's first token after it, or between two of its tokens."""
        gaps = [0.0]
        for times in self.times:
            after = [since] + [t for t in times if t >= since]
            gaps.extend(b - a for a, b in zip(after, after[1:]))
        return max(gaps)


def recovery_section(args, deployment: Deployment) -> dict:
    def streams() -> Streams:
        return Streams([request(i, args.max_tokens) for i in range(args.streams)], timeout_s=300)

    undisturbed = streams()
    asyncio.run(undisturbed.run(deployment.gateway))
    result = {}
    for role, signum in VICTIMS:
        name = f"{role}-{signal.Signals(signum).name}"
        rounds = []
        for _ in range(args.rounds):
            victim: list[Process] = []

            def disturb() -> float:
                if role == "decode":
                    target = max(deployment.workers("decode"), key=lambda p: deployment.stats(p).num_running)
                else:
                    target = deployment.worker("prefill")
                victim.append(target)
                os.kill(target.popen.pid, signum)
                return time.monotonic()

            disturbed = streams()
            struck = asyncio.run(disturbed.run(deployment.gateway, disturb, 5 if role == "decode" else 0))
            rounds.append({"recovery_s": disturbed.longest_gap_after(struck),
                           "tokens_equal": disturbed.tokens == undisturbed.tokens})
            if signum == signal.SIGSTOP:
                os.kill(victim[0].popen.pid, signal.SIGCONT)
                wait_in_rotation(deployment.admin, deployment, 120)
            else:
                deployment.restart(victim[0])
            rounds[-1]["idle_after"] = is_idle_within(deployment, 30)
            print(f"  {name}: recovery {rounds[-1]['recovery_s']:.2f} s, tokens equal: "
                  f"{rounds[-1]['tokens_equal']}", flush=True)
        recoveries = sorted(r["recovery_s"] for r in rounds)
        result[name] = {"rounds": rounds, "max_recovery_s": recoveries[-1],
                        "median_recovery_s": recoveries[len(recoveries) // 2],
                        "all_tokens_equal": all(r["tokens_equal"] for r in rounds),
                        "all_idle_after": all(r["idle_after"] for r in rounds)}
    result["target_met"] = all(v["max_recovery_s"] < RECOVERY_TARGET_S and v["all_tokens_equal"]
                               for v in result.values() if isinstance(v, dict))
    return result


# ------------------------------------------------------------------------- soak
async def soak_load(gateway: str, args, stop_at: float, outcomes: dict[str, int]) -> None:
    """Open-loop Poisson arrivals until `stop_at`; a fraction cancelled at a random moment."""
    rng = random.Random(args.seed)
    pending: set[asyncio.Task] = set()
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            call = stub.GenerateStream(request(i % 64, rng.randint(8, args.max_tokens)), timeout=120)
            cancel_after = rng.uniform(0, 2.0) if rng.random() < args.cancel_fraction else None
            try:
                if cancel_after is None:
                    async for _ in call:
                        pass
                else:
                    await asyncio.sleep(cancel_after)
                    call.cancel()
                code = (await call.code()).name
            except grpc.aio.AioRpcError as error:
                code = error.code().name
            except asyncio.CancelledError:
                code = "CANCELLED"
            outcomes[code] = outcomes.get(code, 0) + 1

        i = 0
        while time.monotonic() < stop_at:
            task = asyncio.create_task(one(i))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*pending, return_exceptions=True)


def soak_section(args, deployment: Deployment) -> dict:
    # Warm up first: a process's first requests grow its RSS for good (grpc buffers, lazy
    # imports, allocator arenas), which is no leak. (Most of the gateway's 90 -> 266 MB in
    # its first 30 s was torch, imported on its first KV handle until KvLayoutSpec stopped
    # needing it.)
    asyncio.run(soak_load(deployment.gateway, args, time.monotonic() + args.soak_warmup_s, {}))
    rss_start = {p.address: rss_bytes(p.popen.pid) for p in deployment.processes}
    outcomes: dict[str, int] = {}
    restarts = []
    stop_at = time.monotonic() + args.soak_s

    async def restarter() -> None:
        workers = [p.address for p in deployment.processes if p.role != "gateway"]
        n = 0
        while time.monotonic() + args.restart_every_s < stop_at:
            await asyncio.sleep(args.restart_every_s)
            victim = next(p for p in deployment.processes if p.address == workers[n % len(workers)])
            signum = signal.SIGTERM if n % 2 == 0 else signal.SIGKILL
            os.kill(victim.popen.pid, signum)
            if signum == signal.SIGTERM:
                await asyncio.to_thread(victim.popen.wait, 60)
            await asyncio.to_thread(deployment.restart, victim)
            restarts.append({"address": victim.address, "signal": signal.Signals(signum).name})
            n += 1

    samples: dict[str, list[tuple[float, float]]] = {p.address: [] for p in deployment.processes}

    async def sample_rss() -> None:  # each process's RSS (MB) over the soak, to see a trend
        started = time.monotonic()
        while time.monotonic() < stop_at:
            for p in list(deployment.processes):
                if rss := rss_or_zero(p.popen.pid):  # 0: being restarted
                    samples[p.address].append((round(time.monotonic() - started), rss / 2**20))
            await asyncio.sleep(min(RSS_SAMPLE_S, max(0.0, stop_at - time.monotonic())))

    async def both() -> None:
        await asyncio.gather(soak_load(deployment.gateway, args, stop_at, outcomes), restarter(), sample_rss())

    asyncio.run(both())
    idle = is_idle_within(deployment, 30)
    rss_end = {p.address: rss_bytes(p.popen.pid) for p in deployment.processes}
    restarted = {r["address"] for r in restarts}
    # None (failing the target) for a process that exited on its own: it reads no RSS.
    growth = {p.address: (rss_end[p.address] / rss_start[p.address] - 1)
              if rss_start[p.address] and rss_end[p.address] else None
              for p in deployment.processes if p.address not in restarted}
    unclear = {code: n for code, n in outcomes.items() if code not in CLEAR_CODES}
    return {
        "seconds": args.soak_s, "rate": args.rate, "cancel_fraction": args.cancel_fraction,
        "outcomes": outcomes, "unclear_outcomes": unclear, "restarts": restarts,
        "idle_after": idle, "rss_start": rss_start, "rss_end": rss_end, "rss_growth_unrestarted": growth,
        "rss_samples_mb_unrestarted": {address: samples[address] for address in growth},
        "target_met": idle and not unclear and all(g is not None and g < RSS_GROWTH_TARGET for g in growth.values()),
    }


# ------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="1 round each, a 60-second soak")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--soak-s", type=float, default=1800.0)
    parser.add_argument("--soak-warmup-s", type=float, default=60.0, help="load before the RSS baseline")
    parser.add_argument("--restart-every-s", type=float, default=180.0)
    parser.add_argument("--rate", type=float, default=8.0, help="soak: requests per second")
    parser.add_argument("--cancel-fraction", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory for chaos.json and the logs")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.soak_s, args.restart_every_s, args.soak_warmup_s = 1, 60.0, 20.0, 15.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="baton-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "sections": {}}
    deployment = deploy(args, out / "logs")
    try:
        for section in args.sections.split(","):
            print(f"{section}:", flush=True)
            run = {"recovery": recovery_section, "soak": soak_section}[section]
            payload["sections"][section] = run(args, deployment)
    finally:
        for process in deployment.processes:
            if process.popen.poll() is None:
                os.kill(process.popen.pid, signal.SIGCONT)
        payload["exit_codes"] = deployment.stop()
    (out / "chaos.json").write_text(json.dumps(payload, indent=2))
    print(json.dumps({name: {k: v for k, v in section.items() if k not in ("rounds", "rss_start", "rss_end")}
                      for name, section in payload["sections"].items()}, indent=2))
    print(f"wrote {out / 'chaos.json'}")
    return 0 if all(section.get("target_met") for section in payload["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
