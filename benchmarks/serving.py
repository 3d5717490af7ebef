"""Online serving benchmark: the engine benchmark's mixed workload, arriving as a Poisson
process, against a running Baton deployment over gRPC or the OpenAI HTTP API.

The systems, one after the other in this order in one run, on the same arrival schedule
(`--rounds N` runs them N times, forward then backward, and pools the rounds):

    disaggregated           gateway + 1 prefill worker + 1 decode worker (separate processes),
                            KV handed over ipc (the default on one host)
    disaggregated+http      the same deployment as disaggregated (one deployment serves both),
                            driven over the gateway's OpenAI HTTP API (streamed /v1/completions)
                            in turn with gRPC: only the front end differs
    disaggregated+tracing   the same, with OpenTelemetry tracing on: every process exports
                            its spans over OTLP/gRPC (default batch span processor) to an
                            in-memory receiver in this process (baton.devtools.otlp_sink)
    disaggregated+gloo      the same as disaggregated, KV handed over Gloo (--kv-transport gloo)
    colocated               gateway + 1 decode worker that prefills itself
    colocated+http          (not by default) colocated's deployment, over HTTP
    engine                  the in-process engine (AsyncEngine, no gRPC), the reference
    multihost-1+1           gateway, prefill worker and decode worker each on a host of its own
                            (network namespaces, baton/devtools/netns.py; needs root), found by
                            DNS, KV across hosts over Gloo on the KV port range
    multihost-2+2           the same with 2 prefill and 2 decode workers, each on its own host
                            (every handoff crosses hosts); on one machine the workers share its
                            cores, so each gets half the threads of 1+1's

`--target grpc://HOST:PORT` / `--target http://HOST:PORT` (repeatable, or a comma list)
measure running gateways instead, each in turn; `--api-key` authenticates. Every pass on
a deployment opens with one unmeasured warm-up request, and sends prompts no earlier pass
sent, so no prefix cache serves one pass the prompts of another
(benchmarks/serving_clients.py, which holds both front ends' clients).

Reported per system: TTFT, TPOT, ITL and end-to-end latency (p50/p90/p99),
output tokens/s and requests/s over the run, goodput beside them (requests completed
within their deadline per second, and their output tokens per second), plus the KV
handoff's observed bandwidth and, with tracing, the spans and traces received; and the
gap from each request's first token to its second, with the gateway's phases of the
pass's requests (p50/p90 of each: baton/runtime/latency.py, from its GatewayAdmin).
`--deadline-s` sends each request with that deadline (gRPC's; over HTTP, X-Request-Timeout),
which the gateway's admission takes as its SLO: a request may then be refused or cut
off, and only those completed within it count as goodput (the in-process engine gets no
deadline; its requests that finished later count as missed). Without it (the default)
no deadline is sent, every request must complete, and goodput equals throughput. Then
the KV transfer comparison between two processes (kvtransfer.bench: ipc, Gloo, a raw Gloo message
and a plain copy of the same bytes). Targets: disaggregated output tokens/s >= 0.9x
engine, and at least Gloo's (disaggregated / disaggregated+gloo >= 1.0); the handoff's
cost to the second token: disaggregated's first-to-second token gap p50 minus colocated's
inter-token latency p50 at most twice the copy's own time (its kv_copy p50) + 10 ms;
disaggregated+tracing output tokens/s >= 0.97x disaggregated (tracing on / off);
HTTP output tokens/s >= 0.95x gRPC's and HTTP TTFT p50 <= 1.1x gRPC's, on the same
deployment (X+http against X; the i-th http:// target against the i-th grpc:// one);
Gloo's block transfer >= 0.9x a raw send/recv of the same bytes. With `--json PATH`,
PATH.png draws the TTFT, TPOT and ITL distributions and each system's throughput.

    python -m benchmarks.serving --rate 4 --num-requests 64
    python -m benchmarks.serving --systems disaggregated,disaggregated+http --rounds 2 --kv-bench-blocks 0

The second pass on a deployment tends to run a few percent faster than the first (on 2
cores, 64 requests at 4/s: 5-9%), warm-up request or not: compare front ends with
`--rounds 2`, which runs them gRPC then HTTP, then HTTP then gRPC.
    python -m benchmarks.serving --target grpc://127.0.0.1:50051,http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks.load import cpu_seconds
from benchmarks.serving_clients import Target, Workload, parse_targets, progress_bar, run_pass, warm_up
from benchmarks.serving_report import HTTP_TWIN, RequestTiming, plot_report, print_report, summarize
from benchmarks.workload import BenchRequest, WorkloadConfig, make_workload

ALL_SYSTEMS = ("disaggregated", "disaggregated+http", "disaggregated+tracing", "disaggregated+gloo", "colocated",
               "colocated+http", "engine", "multihost-1+1", "multihost-2+2")
# multihost-* need root, for network namespaces; colocated+http repeats what disaggregated+http shows.
DEFAULT_SYSTEMS = ("disaggregated", "disaggregated+http", "disaggregated+tracing", "disaggregated+gloo", "colocated",
                   "engine")


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at `rate` requests/s (inf: all at once)."""
    if rate == float("inf"):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def gateway_args(args) -> list[str]:
    """The gateway's routing flags, as asked for (its admission as by default: a Poisson
    burst queues, benchmarks/overload.py refuses)."""
    return [f"--{flag}={value}" for flag, value in (
        ("max-local-prefill-tokens", args.max_local_prefill_tokens),
        ("max-prefill-queue-tokens", args.max_prefill_queue_tokens),
    ) if value is not None]


def run_deployment(name: str, args, requests, offsets, log_dir: Path) -> tuple[list[RequestTiming], dict]:
    """One system on a deployment of its own (benchmarks/gpu_handoff.py's entry)."""
    return run_front_ends([name], args, Workload(requests, offsets), log_dir)[name]


def run_front_ends(names: list[str], args, workload: Workload,
                   log_dir: Path) -> dict[str, tuple[list[RequestTiming], dict]]:
    """One deployment, started for `names` (a system, and its +http twin if asked for),
    driven over each one's front end in turn: the same gateway, workers and model behind
    both, so what the two measure apart is the front end alone. Each pass opens with a
    warm-up request, and its figures are the workers' counters over the pass alone."""
    from baton.cli.local import start_deployment
    from baton.devtools.otlp_sink import OtlpSink

    name = base_system(names[0])
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
            http_port=0 if any(n.endswith(HTTP_TWIN) for n in names) else None,
        )
        gateway = next(p.popen.pid for p in deployment.processes if p.role == "gateway")
        results = {}
        try:
            for system in names:
                front_end, address = (("http", deployment.http) if system.endswith(HTTP_TWIN)
                                      else ("grpc", deployment.gateway))
                warm_up(front_end, address, workload)
                before, _ = _settled(deployment)
                requests, cpu_s, gateway_cpu_s = workload.fresh(), time.process_time(), cpu_seconds(gateway)
                timings = run_pass(front_end, address, requests, workload.offsets, name=system,
                                   deadline_s=getattr(args, "deadline_s", None))
                # What the front end costs the gateway, and what the client takes from the
                # servers on a machine they share.
                extra = {"gateway_cpu_s": cpu_seconds(gateway) - gateway_cpu_s,
                         "client_cpu_s": time.process_time() - cpu_s}
                after, held = _settled(deployment)
                extra.update(pass_phases(deployment, len(requests)))
                results[system] = timings, {**pass_extra(before, after, len(requests), disaggregated, held), **extra}
        finally:
            deployment.stop()
        if tracing:  # a system with no +http twin: the one pass (and its warm-up request)
            spans = sink.spans()  # all of them: the processes flush their spans as they exit
            results[names[0]][1].update(spans_exported=len(spans), traces_exported=len({s.trace_id for s in spans}))
    return results


def pass_phases(deployment, num_requests: int) -> dict:
    """The gateway's phases of the pass's requests, its latest (baton/runtime/latency.py):
    p50 and p90 of each, in ms, and the phase that took most of the time from the first
    token to the second."""
    with deployment.channel(deployment.admin) as channel:
        status = deployment.admin_client(channel).get_deployment_status(timeout=10,
                                                                        latest_requests=num_requests).latency
    if status is None or not status.num_requests:
        return {}
    return {"phases_ms": {p.phase: {"p50": p.p50_s * 1e3, "p90": p.p90_s * 1e3} for p in status.phases},
            "largest_second_token_phase": status.largest}


def pass_extra(before: dict, after: dict, num_requests: int, disaggregated: bool, blocks_left_held: int) -> dict:
    """What the workers did over one pass: their counters from `before` to `after` (each
    worker's WorkerStats by id), the KV handoffs' if `disaggregated`. Prefix cache hits
    should be none (Workload.fresh)."""
    decode = [(before[worker_id], stats) for worker_id, stats in after.items() if stats.role == "decode"]

    def grown(counter: str):
        return sum(getattr(now, counter) - getattr(then, counter) for then, now in decode)

    steps = grown("num_steps")
    seqs = sum(now.num_steps * now.mean_seqs_per_step - then.num_steps * then.mean_seqs_per_step
               for then, now in decode)
    extra = {"mean_seqs_per_step": seqs / max(steps, 1), "kv_blocks_left_held": blocks_left_held,
             "prefix_cache_hit_tokens": sum(now.prefix_cache_hit_tokens - before[worker_id].prefix_cache_hit_tokens
                                            for worker_id, now in after.items())}
    if disaggregated:
        transfers, kv_bytes, seconds = grown("num_transfers"), grown("num_transferred_bytes"), grown("transfer_seconds")
        extra.update(
            handed_off=f"{transfers}/{num_requests}",
            num_transfers=transfers,
            kv_bytes=kv_bytes,
            kv_transfer_seconds=seconds,
            kv_observed_gbps=kv_bytes / max(seconds, 1e-9) / 1e9,
            transfer_failures=grown("num_transfer_failures"),
            kv_transports="+".join(sorted({t.transport for _, now in decode for t in now.kv_transports})),
        )
    return extra


def run_target(target: Target, args, workload: Workload) -> tuple[list[RequestTiming], dict]:
    """A running gateway's front end (`--target`): a warm-up request, then the pass."""
    warm_up(target.front_end, target.address, workload, api_key=args.api_key)
    cpu_s = time.process_time()
    timings = run_pass(target.front_end, target.address, workload.fresh(), workload.offsets, name=target.name,
                       deadline_s=args.deadline_s, api_key=args.api_key)
    return timings, {"client_cpu_s": time.process_time() - cpu_s}


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
            timings = run_pass("grpc", cluster.deployment.gateway, requests, offsets, name=name,
                               deadline_s=args.deadline_s)
            decode = [cluster.deployment.stats(cluster.process(f"decode-{i}")) for i in range(count)]
            transports = sorted({t.transport for stats in decode for t in stats.kv_transports})
            num_bytes = sum(stats.num_transferred_bytes for stats in decode)
            seconds = sum(stats.transfer_seconds for stats in decode)
            extra = {
                "mean_seqs_per_step": float(np.mean([stats.mean_seqs_per_step for stats in decode])),
                "kv_blocks_left_held": _settled(cluster.deployment)[1],
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


def _settled(deployment, timeout_s: float = 60.0) -> tuple[dict, int]:
    """Every worker's WorkerStats (by id) once every request has ended, and the KV blocks
    they still hold if that never happens within `timeout_s` (0: none leaked)."""
    try:
        return deployment.wait_idle(timeout_s), 0
    except TimeoutError:
        stats = {s.worker_id: s for s in (deployment.stats(p) for p in deployment.processes if p.role != "gateway")}
        return stats, sum(s.num_kv_blocks_used for s in stats.values())


# ----------------------------------------------------------------------- engine
def run_engine(args, requests, offsets) -> tuple[list[RequestTiming], dict]:
    from baton.runtime.worker import build_engine
    from engine.async_engine import AsyncEngine
    from engine.config import engine_config
    from engine.envs import configure_process
    from engine.sampling_params import SamplingParams

    configure_process(args.threads)  # as a worker process does
    llm = build_engine(engine_config(args.model, max_num_batched_tokens=args.max_num_batched_tokens))

    async def drive(progress) -> list[RequestTiming]:
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
            progress()
            return timing

        try:
            return await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        finally:
            await engine.stop()

    with progress_bar("engine", len(requests)) as bar:
        timings = asyncio.run(drive(bar.update))
    for timing in timings:  # none was sent: a request that finished later missed it
        timing.deadline_s = args.deadline_s
    return timings, {"mean_seqs_per_step": llm.get_metrics().mean_seqs_per_step}


def base_system(name: str) -> str:
    """The system whose deployment `name` drives: `name` less its +http."""
    return name.removesuffix(HTTP_TWIN)


def deployments(names: list[str]) -> list[list[str]]:
    """`names` in their order, grouped by deployment: a system and its +http twin (next to
    each other in ALL_SYSTEMS' order, forward or backward) drive one deployment."""
    return [list(group) for _, group in itertools.groupby(names, key=base_system)]


def run_systems(group: list[str], args, workload: Workload, log_dir: Path,
                targets: dict[str, Target]) -> dict[str, tuple[list[RequestTiming], dict]]:
    """The systems of one deployment (deployments()), each pass with fresh prompts."""
    name = group[0]
    if name in targets:
        return {name: run_target(targets[name], args, workload)}
    if name == "engine":
        return {name: run_engine(args, workload.fresh(), workload.offsets)}
    if name.startswith("multihost"):
        return {name: run_multihost(name, args, workload.fresh(), workload.offsets, log_dir)}
    return run_front_ends(group, args, workload, log_dir)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="the model to serve; with --target, the one served (its vocabulary draws the prompts)")
    p.add_argument("--systems", default=None,
                   help=f"comma list from {', '.join(ALL_SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--target", action="append", default=[], metavar="URL",
                   help="measure a running gateway instead of starting deployments: grpc://HOST:PORT or "
                        "http://HOST:PORT (repeatable, or a comma list), each in turn on the same schedule")
    p.add_argument("--api-key", default=None, help="--target: sent as Authorization: Bearer <key>")
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
                   help="each request's deadline (gRPC's; HTTP: X-Request-Timeout), its SLO: goodput counts those "
                        "completed within it (default: none sent, goodput = throughput)")
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
    targets = {target.name: target for target in parse_targets(args.target)}
    if targets and args.systems is not None:
        raise SystemExit("--target measures running gateways: it takes no --systems")
    systems = [s for s in (args.systems or ",".join(DEFAULT_SYSTEMS)).split(",") if s] if not targets else []
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))}")
    # In ALL_SYSTEMS' order: tracing on right after off, a system's +http twin beside it.
    names = list(targets) or [s for s in ALL_SYSTEMS if s in systems]
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
    workload = Workload(requests, arrival_offsets(len(requests), args.rate, args.seed))
    runs: dict[str, list[tuple[list[RequestTiming], dict]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        for round_index in range(args.rounds):
            for group in deployments(names if round_index % 2 == 0 else names[::-1]):
                print(f"running {' then '.join(group)} (round {round_index + 1} of {args.rounds}) ...",
                      file=sys.stderr, flush=True)
                for name, run in run_systems(group, args, workload, Path(tmp) / str(round_index), targets).items():
                    runs[name].append(run)
    results = {name: summarize(name, [timings for timings, _ in rounds], [extra for _, extra in rounds])
               for name, rounds in runs.items()}
    kv = None
    if args.kv_bench_blocks and not targets:  # the KV handoff of the deployments this run starts
        from kvtransfer.bench import measure

        print("running the KV transfer comparison ...", file=sys.stderr, flush=True)
        kv = measure(num_blocks_to_send=args.kv_bench_blocks, repeats=args.kv_bench_repeats)
    checks = print_report(results, kv, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "args": {**vars(args), "api_key": args.api_key and "(given)"},  # no secret in the file
            "results": {name: {**asdict(r), "output_tokens_per_s": r.output_tokens_per_s,
                               "requests_per_s": r.requests_per_s,
                               "goodput_output_tokens_per_s": r.goodput_output_tokens_per_s,
                               "goodput_requests_per_s": r.goodput_requests_per_s} for name, r in results.items()},
            "kv_transfer": kv,
            "checks": [check._asdict() for check in checks],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        plot_report(Path(args.json).with_suffix(".png"),
                    {name: [timings for timings, _ in rounds] for name, rounds in runs.items()}, results,
                    f"{args.model}: {args.num_requests} requests, Poisson {args.rate}/s, seed {args.seed}")
    return 0 if all(check.passed for check in checks) else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
