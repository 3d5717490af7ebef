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
output tokens/s and requests/s over the run, goodput beside them (requests completed
within their deadline per second, and their output tokens per second), plus the KV
handoff's observed bandwidth and, with tracing, the spans and traces received.
`--deadline-s` sends each request with that gRPC deadline, which the gateway's admission
takes as its SLO: a request may then be refused or cut off, and only those completed
within it count as goodput (the in-process engine gets no deadline; its requests that
finished later count as missed). Without it (the default) no deadline is sent, every
request must complete, and goodput equals throughput. Then the KV transfer
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
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks.serving_report import RequestTiming, print_report, summarize
from benchmarks.workload import BenchRequest, WorkloadConfig, make_workload

ALL_SYSTEMS = ("disaggregated", "disaggregated+tracing", "disaggregated+gloo", "colocated", "engine",
               "multihost-1+1", "multihost-2+2")
# Not run unless asked for (--systems): they need root, for network namespaces.
DEFAULT_SYSTEMS = ALL_SYSTEMS[:5]


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at `rate` requests/s (inf: all at once)."""
    if rate == float("inf"):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# ------------------------------------------------------------------------- gRPC
async def drive_grpc(address: str, requests: list[BenchRequest], offsets: list[float],
                     deadline_s: float | None = None) -> list[RequestTiming]:
    """Each request at its offset; with `deadline_s`, as each call's gRPC deadline, a call
    that fails is recorded with its status (without, it stops the run)."""
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
            timing.deadline_s = deadline_s
            try:
                async for reply in stub.GenerateStream(message, timeout=deadline_s or 3600):
                    now = time.perf_counter() - sent
                    timing.token_times.extend([now] * len(reply.token_ids))
                    timing.num_output_tokens += len(reply.token_ids)
            except grpc.aio.AioRpcError as error:
                if deadline_s is None:
                    raise
                timing.status = error.code().name
            timing.finished = time.perf_counter() - sent
            if timing.status == "OK" and timing.num_output_tokens != request.max_tokens:
                raise RuntimeError(f"{request.request_id}: {timing.num_output_tokens} of {request.max_tokens} tokens")
            return timing

        return await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))


def gateway_args(args) -> list[str]:
    """The gateway's routing flags, as asked for (its admission as by default: a Poisson
    burst queues, benchmarks/overload.py refuses)."""
    return [f"--{flag}={value}" for flag, value in (
        ("max-local-prefill-tokens", args.max_local_prefill_tokens),
        ("max-prefill-queue-tokens", args.max_prefill_queue_tokens),
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
            timings = asyncio.run(drive_grpc(deployment.gateway, requests, offsets,
                                             getattr(args, "deadline_s", None)))
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
            timings = asyncio.run(drive_grpc(cluster.deployment.gateway, requests, offsets, args.deadline_s))
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
    for timing in timings:  # none was sent: a request that finished later missed it
        timing.deadline_s = args.deadline_s
    return timings, {"mean_seqs_per_step": llm.get_metrics().mean_seqs_per_step}


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
    p.add_argument("--deadline-s", type=float, default=None,
                   help="each request's gRPC deadline, its SLO: goodput counts those completed within it "
                        "(default: none sent, goodput = throughput)")
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
                               "requests_per_s": r.requests_per_s,
                               "goodput_output_tokens_per_s": r.goodput_output_tokens_per_s,
                               "goodput_requests_per_s": r.goodput_requests_per_s} for name, r in results.items()},
            "kv_transfer": kv,
            "checks": [{"name": n, "value": v, "target": t, "passed": p} for n, v, t, p in checks],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0 if all(passed for *_, passed in checks) else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
