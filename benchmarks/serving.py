"""Online serving benchmark: the engine benchmark's mixed workload, arriving as a Poisson
process, against a running Baton deployment over gRPC.

Four systems, one after the other in this order in one run, on the same arrival schedule
(`--rounds N` runs them N times, forward then backward, and pools the rounds):

    disaggregated           gateway + 1 prefill worker + 1 decode worker (separate processes),
                            KV handed over ipc (the default on one host)
    disaggregated+tracing   the same, with OpenTelemetry tracing on: every process exports
                            its spans over OTLP/gRPC (default batch span processor) to an
                            in-memory receiver in this process (baton.devtools.otlp_sink)
    disaggregated+gloo      the same as disaggregated, KV handed over Gloo (--kv-transport gloo)
    colocated               gateway + 1 decode worker that prefills itself
    engine                  the in-process engine (AsyncEngine, no gRPC), the reference
    multihost-1+1           gateway, prefill worker and decode worker each on a host of its own
                            (network namespaces, baton/devtools/netns.py; needs root), found by
                            DNS, KV across hosts over Gloo on the KV port range
    multihost-2+2           the same with 2 prefill and 2 decode workers, each on its own host
                            (every handoff crosses hosts); on one machine the workers share its
                            cores, so each gets half the threads of 1+1's

Reported per system: TTFT, TPOT, ITL and end-to-end latency (p50/p90/p99),
output tokens/s and requests/s over the run, plus the KV handoff's observed
bandwidth and, with tracing, the spans and traces received. Then the KV transfer
comparison between two processes (kvtransfer.bench: ipc, Gloo, a raw Gloo message
and a plain copy of the same bytes). Targets: disaggregated output tokens/s >= 0.9x
engine, and at least Gloo's (disaggregated / disaggregated+gloo >= 1.0);
disaggregated+tracing output tokens/s >= 0.97x disaggregated (tracing on / off);
Gloo's block transfer >= 0.9x a raw send/recv of the same bytes.

    python -m benchmarks.serving --rate 4 --num-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.workload import BenchRequest, WorkloadConfig, make_workload

ALL_SYSTEMS = ("disaggregated", "disaggregated+tracing", "disaggregated+gloo", "colocated", "engine",
               "multihost-1+1", "multihost-2+2")
# Not run unless asked for (--systems): they need root, for network namespaces.
DEFAULT_SYSTEMS = ALL_SYSTEMS[:5]


@dataclass
class RequestTiming:
    """One request's timeline (seconds, relative to its send time)."""

    arrival: float
    token_times: list[float] = field(default_factory=list)  # one entry per generated token
    num_output_tokens: int = 0
    finished: float = 0.0


@dataclass
class SystemResult:
    name: str
    seconds: float
    num_requests: int
    num_output_tokens: int
    ttft: dict
    tpot: dict
    itl: dict
    e2e: dict
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    array = np.asarray(values)
    return {
        "p50": float(np.percentile(array, 50)),
        "p90": float(np.percentile(array, 90)),
        "p99": float(np.percentile(array, 99)),
        "mean": float(array.mean()),
    }


def summarize(name: str, rounds: list[list[RequestTiming]], extras: list[dict] | None = None) -> SystemResult:
    """One system's figures over its rounds: the run's seconds are the sum of each
    round's first arrival to last finish; latencies pool every request."""
    seconds = sum(max(t.arrival + t.finished for t in timings) - min(t.arrival for t in timings)
                  for timings in rounds)
    timings = [t for round_timings in rounds for t in round_timings]
    ttft, tpot, itl, e2e = [], [], [], []
    for t in timings:
        ttft.append(t.token_times[0])
        e2e.append(t.finished)
        if len(t.token_times) > 1:
            tpot.append((t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1))
            itl.extend(np.diff(t.token_times).tolist())
    extras = extras or [{}]
    extra = extras[0] if len(extras) == 1 else {
        **{f"round{i + 1}": e for i, e in enumerate(extras)},
        "round_output_tokens_per_s": [sum(t.num_output_tokens for t in r) /
                                      (max(t.arrival + t.finished for t in r) - min(t.arrival for t in r))
                                      for r in rounds],
    }
    return SystemResult(
        name,
        seconds,
        len(timings),
        sum(t.num_output_tokens for t in timings),
        percentiles(ttft),
        percentiles(tpot),
        percentiles(itl),
        percentiles(e2e),
        extra,
    )


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at `rate` requests/s (inf: all at once)."""
    if rate == float("inf"):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# ------------------------------------------------------------------------- gRPC
async def drive_grpc(address: str, requests: list[BenchRequest], offsets: list[float]) -> list[RequestTiming]:
    import grpc

    from baton.wire.v1 import generation_pb2 as pb
    from baton.wire.v1 import generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        base = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, base + offset - time.perf_counter()))
            sent = time.perf_counter()
            timing = RequestTiming(arrival=sent - base)
            message = pb.GenerateRequest(
                request_id=request.request_id,
                token_ids=pb.TokenIds(ids=request.prompt_token_ids),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True),
            )
            async for reply in stub.GenerateStream(message, timeout=3600):
                now = time.perf_counter() - sent
                timing.token_times.extend([now] * len(reply.token_ids))
                timing.num_output_tokens += len(reply.token_ids)
            timing.finished = time.perf_counter() - sent
            if timing.num_output_tokens != request.max_tokens:
                raise RuntimeError(f"{request.request_id}: {timing.num_output_tokens} of {request.max_tokens} tokens")
            return timing

        return await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))


def gateway_args(args) -> list[str]:
    """The gateway's routing flags, as asked for, and no admission bound on queued tokens."""
    return [f"--{flag}={value}" for flag, value in (
        ("max-local-prefill-tokens", args.max_local_prefill_tokens),
        ("max-prefill-queue-tokens", args.max_prefill_queue_tokens),
        # Throughput, not overload (benchmarks/overload.py): every request is served, as by
        # the in-process engine; the gateway's default bound would refuse a Poisson burst's prompts.
        ("max-queued-tokens", 1 << 30),
    ) if value is not None]


def run_deployment(name: str, args, requests, offsets, log_dir: Path) -> tuple[list[RequestTiming], dict]:
    from baton.cli.local import start_deployment
    from baton.devtools.otlp_sink import OtlpSink

    disaggregated = name.startswith("disaggregated")
    tracing = name == "disaggregated+tracing"
    worker_args = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    prefill_args, decode_args, stagger = [], [], False
    if getattr(args, "device", "cpu") != "cpu":
        # On a GPU the workers are laid out as `baton up --device` lays them out: on one GPU
        # they split its memory, the prefill worker started first (its flags come from there).
        from baton.cli.launcher import UpSettings, role_args

        up = UpSettings(model=args.model, device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
                        prefill_memory_fraction=args.prefill_memory_fraction, colocated=not disaggregated,
                        max_model_len=getattr(args, "max_model_len", None))
        roles = role_args(up)
        worker_args += roles.worker
        prefill_args, decode_args, stagger = roles.prefill, roles.decode, up.shares_a_gpu
    if name == "disaggregated+gloo":
        worker_args += ["--kv-transport", "gloo"]
    if args.verify_kv:
        worker_args.append("--verify-kv")
    decode_threads = args.decode_threads if disaggregated else args.threads
    with OtlpSink() if tracing else contextlib.nullcontext() as sink:
        # Tracing off for the other systems, whatever this shell's OTEL_* variables say.
        env = {"OTEL_SDK_DISABLED": "true"}
        if tracing:  # every process exports its spans to the sink
            env = {"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink.endpoint,
                   "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
        deployment = start_deployment(
            args.model,
            log_dir / name,
            prefill=disaggregated,
            worker_args=worker_args,
            prefill_args=["--threads", str(args.prefill_threads), *prefill_args],
            decode_args=["--threads", str(decode_threads), *decode_args],
            stagger=stagger,
            gateway_args=gateway_args(args),
            threads=decode_threads,
            timeout_s=900,
            env=env,
        )
        try:
            timings = asyncio.run(drive_grpc(deployment.gateway, requests, offsets))
            decode = deployment.stats("decode")
            extra = {"mean_seqs_per_step": decode.mean_seqs_per_step,
                     "kv_blocks_left_held": _blocks_left_held(deployment)}
            if disaggregated:
                extra.update(
                    handed_off=f"{decode.num_transfers}/{len(requests)}",
                    num_transfers=decode.num_transfers,
                    kv_bytes=decode.num_transferred_bytes,
                    kv_transfer_seconds=decode.transfer_seconds,
                    kv_observed_gbps=decode.num_transferred_bytes / max(decode.transfer_seconds, 1e-9) / 1e9,
                    transfer_failures=decode.num_transfer_failures,
                    kv_transports="+".join(t.transport for t in decode.kv_transports),
                )
        finally:
            deployment.stop()
        if tracing:
            spans = sink.spans()  # all of them: the processes flush their spans as they exit
            extra.update(spans_exported=len(spans), traces_exported=len({span.trace_id for span in spans}))
    return timings, extra


def run_multihost(name: str, args, requests, offsets, log_dir: Path) -> tuple[list[RequestTiming], dict]:
    """P prefill and D decode workers, each on a host (network namespace) of its own."""
    from baton.devtools.multihost import MultiHost
    from baton.devtools.netns import Network, available

    reason = available()
    if reason:
        raise SystemExit(f"{name}: {reason}")
    count = int(name.split("-")[1].split("+")[0])
    hosts = [f"h{i}" for i in range(2 * count)]
    # The machine's cores are shared by every worker: more workers, fewer threads each.
    prefill_threads, decode_threads = max(1, args.prefill_threads // count), max(1, args.decode_threads // count)
    Network.cleanup_stale()
    with Network(["gw", *hosts]) as network:
        cluster = MultiHost.start(
            network, args.model, log_dir / name, gateway="gw",
            prefill=[(f"prefill-{i}", hosts[i]) for i in range(count)],
            decode=[(f"decode-{i}", hosts[count + i]) for i in range(count)],
            worker_args=["--max-num-batched-tokens", str(args.max_num_batched_tokens),
                         *(["--verify-kv"] if args.verify_kv else [])],
            prefill_args=["--threads", str(prefill_threads)], decode_args=["--threads", str(decode_threads)],
            gateway_args=gateway_args(args),
            threads=decode_threads, timeout_s=900,
        )
        try:
            timings = asyncio.run(drive_grpc(cluster.deployment.gateway, requests, offsets))
            decode = [cluster.deployment.stats(cluster.process(f"decode-{i}")) for i in range(count)]
            transports = sorted({t.transport for stats in decode for t in stats.kv_transports})
            num_bytes = sum(stats.num_transferred_bytes for stats in decode)
            seconds = sum(stats.transfer_seconds for stats in decode)
            extra = {
                "mean_seqs_per_step": float(np.mean([stats.mean_seqs_per_step for stats in decode])),
                "kv_blocks_left_held": _blocks_left_held(cluster.deployment),
                "handed_off": f"{sum(stats.num_transfers for stats in decode)}/{len(requests)}",
                "num_transfers": sum(stats.num_transfers for stats in decode),
                "kv_bytes": num_bytes,
                "kv_observed_gbps": num_bytes / max(seconds, 1e-9) / 1e9,
                "transfer_failures": sum(stats.num_transfer_failures for stats in decode),
                "kv_transports": "+".join(transports),
                "threads_per_worker": f"prefill {prefill_threads}, decode {decode_threads}",
            }
        finally:
            cluster.stop()
    return timings, extra


def _blocks_left_held(deployment, timeout_s: float = 60.0) -> int:
    """KV blocks the workers still hold once every request has ended (0: none leaked)."""
    try:
        deployment.wait_idle(timeout_s)
        return 0
    except TimeoutError:
        return sum(deployment.stats(p).num_kv_blocks_used for p in deployment.processes if p.role != "gateway")


# ----------------------------------------------------------------------- engine
def run_engine(args, requests, offsets) -> tuple[list[RequestTiming], dict]:
    from baton.runtime.worker import build_engine
    from engine.async_engine import AsyncEngine
    from engine.config import engine_config
    from engine.envs import configure_process
    from engine.sampling_params import SamplingParams

    configure_process(args.threads)  # as a worker process does
    llm = build_engine(engine_config(args.model, max_num_batched_tokens=args.max_num_batched_tokens))

    async def drive() -> list[RequestTiming]:
        engine = AsyncEngine(llm)
        engine.start()
        base = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, base + offset - time.perf_counter()))
            sent = time.perf_counter()
            timing = RequestTiming(arrival=sent - base)
            params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
            stream = await engine.add_request(request.request_id, request.prompt_token_ids, params)
            async for output in stream:
                now = time.perf_counter() - sent
                timing.token_times.extend([now] * len(output.new_token_ids))
                timing.num_output_tokens += len(output.new_token_ids)
            timing.finished = time.perf_counter() - sent
            return timing

        try:
            return await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        finally:
            await engine.stop()

    timings = asyncio.run(drive())
    return timings, {"mean_seqs_per_step": llm.get_metrics().mean_seqs_per_step}


# ----------------------------------------------------------------------- report
def print_report(results: dict[str, SystemResult], kv: dict | None, args) -> list[tuple[str, float, float, bool]]:
    print(f"\nworkload: {args.num_requests} requests, Poisson rate {args.rate}/s, seed {args.seed}, "
          f"prompts {args.min_prompt_len}-{args.max_prompt_len}, outputs {args.min_output_len}-{args.max_output_len}")
    width = max([14, *(len(name) for name in results)])
    header = f"{'system':<{width}} {'out tok/s':>9} {'req/s':>6} " + " ".join(
        f"{m + ' p50/p90/p99 ms':>26}" for m in ("TTFT", "TPOT", "ITL", "E2E")
    )
    print(header)
    for result in results.values():
        cells = []
        for metric in (result.ttft, result.tpot, result.itl, result.e2e):
            cells.append(f"{metric['p50'] * 1e3:8.1f}/{metric['p90'] * 1e3:8.1f}/{metric['p99'] * 1e3:8.1f}")
        print(f"{result.name:<{width}} {result.output_tokens_per_s:9.1f} {result.requests_per_s:6.2f} " + " ".join(
            f"{c:>26}" for c in cells))
    def fields(extra: dict) -> str:
        return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
                         if not isinstance(v, (dict, list)))

    for result in results.values():
        if args.rounds == 1 and result.extra:
            print(f"  {result.name}: {fields(result.extra)}")
        for i in range(args.rounds if args.rounds > 1 else 0):
            rate = result.extra["round_output_tokens_per_s"][i]
            print(f"  {result.name} round {i + 1}: out tok/s={rate:.1f}, {fields(result.extra[f'round{i + 1}'])}")
    checks = []
    if "disaggregated" in results and "engine" in results:
        ratio = results["disaggregated"].output_tokens_per_s / results["engine"].output_tokens_per_s
        checks.append(("disaggregated / engine output tok/s", ratio, 0.9, ratio >= 0.9))
    if "disaggregated+tracing" in results and "disaggregated" in results:
        ratio = results["disaggregated+tracing"].output_tokens_per_s / results["disaggregated"].output_tokens_per_s
        checks.append(("tracing on / off output tok/s", ratio, 0.97, ratio >= 0.97))
        if args.rounds > 1:
            per_round = [on / off for on, off in zip(results["disaggregated+tracing"].extra["round_output_tokens_per_s"],
                                                     results["disaggregated"].extra["round_output_tokens_per_s"])]
            print("tracing on / off by round: " + ", ".join(f"{r:.3f}" for r in per_round))
    if "disaggregated+gloo" in results and "engine" in results:
        ratio = results["disaggregated+gloo"].output_tokens_per_s / results["engine"].output_tokens_per_s
        checks.append(("disaggregated+gloo / engine output tok/s", ratio, 0.0, True))
    if "disaggregated+gloo" in results and "disaggregated" in results:
        ratio = results["disaggregated"].output_tokens_per_s / results["disaggregated+gloo"].output_tokens_per_s
        checks.append(("disaggregated (ipc) / disaggregated+gloo output tok/s", ratio, 1.0, ratio >= 1.0))
    if "colocated" in results and "engine" in results:
        ratio = results["colocated"].output_tokens_per_s / results["engine"].output_tokens_per_s
        checks.append(("colocated / engine output tok/s", ratio, 0.0, True))
    if "multihost-2+2" in results and "multihost-1+1" in results:
        # On one machine the 2+2 workers share the cores 1+1's had: the bound is ~1x.
        ratio = results["multihost-2+2"].output_tokens_per_s / results["multihost-1+1"].output_tokens_per_s
        checks.append((f"multihost 2+2 / 1+1 output tok/s (same {os.cpu_count()} cores)", ratio, 0.0, True))
    if kv is not None:
        from kvtransfer.bench import describe

        print("\nKV transfer between two processes, " + describe(kv))
        checks.append(("KV block transfer over Gloo / raw send/recv bandwidth", kv["ratio"], 0.9, kv["ratio"] >= 0.9))
        checks.append(("KV transfer ipc / Gloo speed", kv["ipc_vs_gloo"], 1.0, kv["ipc_vs_gloo"] >= 1.0))
    print()
    for name, value, target, passed in checks:
        verdict = "PASS" if passed else "FAIL"
        target_text = f"target >= {target}" if target else "reported"
        print(f"{name}: {value:.3f} ({target_text}) {verdict if target else ''}")
    return checks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma list from {', '.join(ALL_SYSTEMS)}")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (inf: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=8)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="threads of the engine and of a colocated worker")
    p.add_argument("--prefill-threads", type=int, default=2,
                   help="disaggregated: prefill worker threads (the workers share the cores; idle ones sleep)")
    p.add_argument("--decode-threads", type=int, default=2,
                   help="disaggregated: decode worker threads (the workers share the cores; idle ones sleep)")
    p.add_argument("--max-local-prefill-tokens", type=int, default=None,
                   help="gateway routing (default: the gateway's): prompts this short prefill on the decode worker")
    p.add_argument("--max-prefill-queue-tokens", type=int, default=None,
                   help="gateway routing (default: the gateway's): prefill queue above which prompts may go local")
    p.add_argument("--verify-kv", action="store_true", help="checksum every handed-off block")
    p.add_argument("--kv-bench-blocks", type=int, default=64, help="blocks in the raw-vs-block KV comparison (0: skip)")
    p.add_argument("--kv-bench-repeats", type=int, default=9)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, in order then in reverse (ABBA), so slow drift of "
                        "the machine cancels out of the ratios; figures pool the rounds")
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))}")
    systems = [s for s in ALL_SYSTEMS if s in systems]  # in ALL_SYSTEMS' order: tracing on right after off
    from transformers import AutoConfig  # noqa: F401  (fail early if transformers is broken)

    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    vocab_size = len(tokenizer) if tokenizer is not None else 49152
    config = WorkloadConfig(
        num_requests=args.num_requests,
        min_prompt_len=args.min_prompt_len,
        max_prompt_len=args.max_prompt_len,
        min_output_len=args.min_output_len,
        max_output_len=args.max_output_len,
        seed=args.seed,
    )
    requests = make_workload(vocab_size, config)
    offsets = arrival_offsets(len(requests), args.rate, args.seed)
    runs: dict[str, list[tuple[list[RequestTiming], dict]]] = {name: [] for name in systems}
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        for round_index in range(args.rounds):
            for name in systems if round_index % 2 == 0 else systems[::-1]:
                print(f"running {name} (round {round_index + 1} of {args.rounds}) ...", file=sys.stderr, flush=True)
                if name == "engine":
                    runs[name].append(run_engine(args, requests, offsets))
                elif name.startswith("multihost"):
                    runs[name].append(run_multihost(name, args, requests, offsets, Path(tmp) / str(round_index)))
                else:
                    runs[name].append(run_deployment(name, args, requests, offsets, Path(tmp) / str(round_index)))
    results = {name: summarize(name, [timings for timings, _ in rounds], [extra for _, extra in rounds])
               for name, rounds in runs.items()}
    kv = None
    if args.kv_bench_blocks:
        from kvtransfer.bench import measure

        print("running the KV transfer comparison ...", file=sys.stderr, flush=True)
        kv = measure(num_blocks_to_send=args.kv_bench_blocks, repeats=args.kv_bench_repeats)
    checks = print_report(results, kv, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "args": vars(args),
            "results": {name: {**asdict(r), "output_tokens_per_s": r.output_tokens_per_s,
                               "requests_per_s": r.requests_per_s} for name, r in results.items()},
            "kv_transfer": kv,
            "checks": [{"name": n, "value": v, "target": t, "passed": p} for n, v, t, p in checks],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0 if all(passed for *_, passed in checks) else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
