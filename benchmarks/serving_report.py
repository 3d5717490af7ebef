"""What a run of benchmarks/serving.py measured: each request's timeline as its client saw
it (RequestTiming), each system's figures over its rounds (summarize: latencies,
throughput and goodput), the report with its targets (print_report), and its plots
(plot_report)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np


@dataclass
class RequestTiming:
    """One request's timeline (seconds, relative to its send time)."""

    arrival: float
    token_times: list[float] = field(default_factory=list)  # one entry per generated token
    num_output_tokens: int = 0
    finished: float = 0.0
    status: str = "OK"  # or the gRPC status name it failed with (only with a deadline)
    deadline_s: float | None = None  # the time it had (None: no deadline)

    @property
    def is_within_deadline(self) -> bool:
        return self.status == "OK" and (self.deadline_s is None or self.finished <= self.deadline_s)


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
    second_token_gap: dict = field(default_factory=dict)  # first token to second, per request
    num_sent: int = 0  # num_requests completed; the others failed (only with a deadline)
    statuses: dict = field(default_factory=dict)  # how many ended with each status
    num_good_requests: int = 0  # completed within their deadline
    num_good_output_tokens: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def goodput_requests_per_s(self) -> float:
        return self.num_good_requests / self.seconds

    @property
    def goodput_output_tokens_per_s(self) -> float:
        return self.num_good_output_tokens / self.seconds


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


class Check(NamedTuple):
    """A figure against its target: at least `target` (at most, if `at_most`); a target
    of 0 marks a figure that is only reported."""

    name: str
    value: float
    target: float
    passed: bool
    at_most: bool = False


def latency_samples(timings: list[RequestTiming]) -> dict[str, list[float]]:
    """The completed requests' TTFT, TPOT, end-to-end seconds and the gap from their first
    token to their second (one each), and every inter-token gap (ITL)."""
    samples = {"ttft": [], "tpot": [], "itl": [], "e2e": [], "second_token_gap": []}
    for t in timings:
        if t.status != "OK":
            continue
        samples["ttft"].append(t.token_times[0])
        samples["e2e"].append(t.finished)
        if len(t.token_times) > 1:
            samples["tpot"].append((t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1))
            samples["itl"].extend(np.diff(t.token_times).tolist())
            samples["second_token_gap"].append(t.token_times[1] - t.token_times[0])
    return samples


def summarize(name: str, rounds: list[list[RequestTiming]], extras: list[dict] | None = None) -> SystemResult:
    """One system's figures over its rounds: the run's seconds are the sum of each
    round's first arrival to last finish (or failure); latencies pool every completed request."""
    seconds = sum(max(t.arrival + t.finished for t in timings) - min(t.arrival for t in timings)
                  for timings in rounds)
    sent = [t for round_timings in rounds for t in round_timings]
    timings = [t for t in sent if t.status == "OK"]
    good = [t for t in timings if t.is_within_deadline]
    samples = latency_samples(timings)
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
        percentiles(samples["ttft"]),
        percentiles(samples["tpot"]),
        percentiles(samples["itl"]),
        percentiles(samples["e2e"]),
        extra,
        second_token_gap=percentiles(samples["second_token_gap"]),
        num_sent=len(sent),
        statuses={status: sum(1 for t in sent if t.status == status) for status in sorted({t.status for t in sent})},
        num_good_requests=len(good),
        num_good_output_tokens=sum(t.num_output_tokens for t in good),
    )


HTTP_TWIN = "+http"  # a system's twin: its deployment, driven over the OpenAI HTTP API


def front_end_pairs(names: list[str]) -> list[tuple[str, str]]:
    """(gRPC, HTTP) systems that drove the same deployment: X and X+http, and the i-th
    grpc:// target with the i-th http:// one."""
    twins = [(name.removesuffix(HTTP_TWIN), name) for name in names
             if name.endswith(HTTP_TWIN) and name.removesuffix(HTTP_TWIN) in names]
    grpc = [name for name in names if name.startswith("grpc://")]
    http = [name for name in names if name.startswith("http://")]
    return twins + list(zip(grpc, http))


def front_end_checks(results: dict[str, SystemResult], rounds: int) -> list[Check]:
    """HTTP against gRPC on one deployment: output tok/s >= 0.95x, TTFT p50 <= 1.1x."""
    checks = []
    for grpc_name, http_name in front_end_pairs(list(results)):
        grpc, http = results[grpc_name], results[http_name]
        print(f"{http_name} vs {grpc_name}: output tok/s {http.output_tokens_per_s:.1f} vs "
              f"{grpc.output_tokens_per_s:.1f}, TTFT p50 {http.ttft['p50'] * 1e3:.1f} vs "
              f"{grpc.ttft['p50'] * 1e3:.1f} ms, TPOT p50 {http.tpot['p50'] * 1e3:.1f} vs "
              f"{grpc.tpot['p50'] * 1e3:.1f} ms")
        if rounds > 1:
            per_round = [h / g for h, g in zip(http.extra["round_output_tokens_per_s"],
                                               grpc.extra["round_output_tokens_per_s"])]
            print(f"{http_name} / {grpc_name} output tok/s by round: " + ", ".join(f"{r:.3f}" for r in per_round))
        ratio = http.output_tokens_per_s / grpc.output_tokens_per_s
        checks.append(Check(f"{http_name} / {grpc_name} output tok/s", ratio, 0.95, ratio >= 0.95))
        ratio = http.ttft["p50"] / grpc.ttft["p50"]
        checks.append(Check(f"{http_name} / {grpc_name} TTFT p50", ratio, 1.1, ratio <= 1.1, at_most=True))
        ratio = http.tpot["p50"] / grpc.tpot["p50"]
        checks.append(Check(f"{http_name} / {grpc_name} TPOT p50", ratio, 0.0, True))
    return checks


def print_report(results: dict[str, SystemResult], kv: dict | None, args) -> list[Check]:
    print(f"\nworkload: {args.num_requests} requests, Poisson rate {args.rate}/s, seed {args.seed}, "
          f"prompts {args.min_prompt_len}-{args.max_prompt_len}, outputs {args.min_output_len}-{args.max_output_len}")
    deadline_s = getattr(args, "deadline_s", None)
    print(f"goodput: requests completed within a {deadline_s:g} s deadline, and their tokens" if deadline_s
          else "goodput: no deadline sent (--deadline-s), so every completed request: goodput = throughput")
    width = max([14, *(len(name) for name in results)])
    header = f"{'system':<{width}} {'out tok/s':>9} {'req/s':>6} {'good tok/s':>10} {'good req/s':>10} " + " ".join(
        f"{m + ' p50/p90/p99 ms':>26}" for m in ("TTFT", "TPOT", "ITL", "E2E")
    )
    print(header)
    for result in results.values():
        cells = []
        for metric in (result.ttft, result.tpot, result.itl, result.e2e):
            cells.append(f"{metric['p50'] * 1e3:8.1f}/{metric['p90'] * 1e3:8.1f}/{metric['p99'] * 1e3:8.1f}")
        print(f"{result.name:<{width}} {result.output_tokens_per_s:9.1f} {result.requests_per_s:6.2f} "
              f"{result.goodput_output_tokens_per_s:10.1f} {result.goodput_requests_per_s:10.2f} " + " ".join(
                  f"{c:>26}" for c in cells))
        if result.num_sent != result.num_requests:
            print(f"  {result.name}: {result.num_requests} of {result.num_sent} completed: {result.statuses}")
    def fields(extra: dict) -> str:
        return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
                         if not isinstance(v, (dict, list)))

    for result in results.values():
        if args.rounds == 1 and result.extra:
            print(f"  {result.name}: {fields(result.extra)}")
        for i in range(args.rounds if args.rounds > 1 else 0):
            rate = result.extra["round_output_tokens_per_s"][i]
            print(f"  {result.name} round {i + 1}: out tok/s={rate:.1f}, {fields(result.extra[f'round{i + 1}'])}")
    print_phases(results)
    checks = []
    if "disaggregated" in results and "colocated" in results:
        checks.append(handoff_check(results["disaggregated"], results["colocated"]))
    if "disaggregated" in results and "engine" in results:
        ratio = results["disaggregated"].output_tokens_per_s / results["engine"].output_tokens_per_s
        checks.append(Check("disaggregated / engine output tok/s", ratio, 0.9, ratio >= 0.9))
    if "disaggregated+tracing" in results and "disaggregated" in results:
        ratio = results["disaggregated+tracing"].output_tokens_per_s / results["disaggregated"].output_tokens_per_s
        checks.append(Check("tracing on / off output tok/s", ratio, 0.97, ratio >= 0.97))
        if args.rounds > 1:
            per_round = [on / off for on, off in zip(results["disaggregated+tracing"].extra["round_output_tokens_per_s"],
                                                     results["disaggregated"].extra["round_output_tokens_per_s"])]
            print("tracing on / off by round: " + ", ".join(f"{r:.3f}" for r in per_round))
    if "disaggregated+gloo" in results and "engine" in results:
        ratio = results["disaggregated+gloo"].output_tokens_per_s / results["engine"].output_tokens_per_s
        checks.append(Check("disaggregated+gloo / engine output tok/s", ratio, 0.0, True))
    if "disaggregated+gloo" in results and "disaggregated" in results:
        ratio = results["disaggregated"].output_tokens_per_s / results["disaggregated+gloo"].output_tokens_per_s
        checks.append(Check("disaggregated (ipc) / disaggregated+gloo output tok/s", ratio, 1.0, ratio >= 1.0))
    if "colocated" in results and "engine" in results:
        ratio = results["colocated"].output_tokens_per_s / results["engine"].output_tokens_per_s
        checks.append(Check("colocated / engine output tok/s", ratio, 0.0, True))
    if "multihost-2+2" in results and "multihost-1+1" in results:
        # On one machine the 2+2 workers share the cores 1+1's had: the bound is ~1x.
        ratio = results["multihost-2+2"].output_tokens_per_s / results["multihost-1+1"].output_tokens_per_s
        checks.append(Check(f"multihost 2+2 / 1+1 output tok/s (same {os.cpu_count()} cores)", ratio, 0.0, True))
    checks += front_end_checks(results, args.rounds)
    if kv is not None:
        from kvtransfer.bench import describe

        print("\nKV transfer between two processes, " + describe(kv))
        checks.append(Check("KV block transfer over Gloo / raw send/recv bandwidth", kv["ratio"], 0.9,
                            kv["ratio"] >= 0.9))
        checks.append(Check("KV transfer ipc / Gloo speed", kv["ipc_vs_gloo"], 1.0, kv["ipc_vs_gloo"] >= 1.0))
    print()
    for check in checks:
        verdict = ("PASS" if check.passed else "FAIL") if check.target else ""
        target_text = f"target {'<=' if check.at_most else '>='} {check.target}" if check.target else "reported"
        print(f"{check.name}: {check.value:.3f} ({target_text}) {verdict}".rstrip())
    return checks


def print_phases(results: dict[str, SystemResult]) -> None:
    """Each system's time to the second token, and the gateway's phases of its requests
    (baton/runtime/latency.py; p50/p90 ms, one round's)."""
    for result in results.values():
        gap = result.second_token_gap
        phases = result.extra.get("phases_ms") or result.extra.get("round1", {}).get("phases_ms")
        if not gap or not phases:
            continue
        print(f"  {result.name}: first to second token p50/p90 {gap['p50'] * 1e3:.1f}/{gap['p90'] * 1e3:.1f} ms; "
              "phases p50/p90 ms: " + ", ".join(f"{name} {p['p50']:.1f}/{p['p90']:.1f}" for name, p in phases.items()))


def handoff_check(disaggregated: SystemResult, colocated: SystemResult) -> Check:
    """What the handoff adds to the second token: the disaggregated system's first-to-second
    token gap p50 over the colocated one's inter-token latency p50, at most twice the
    copy's own time (its kv_copy phase p50) plus 10 ms."""
    phases = disaggregated.extra.get("phases_ms") or disaggregated.extra.get("round1", {}).get("phases_ms") or {}
    copy_ms = phases.get("kv_copy", {}).get("p50", float("nan"))
    added_ms = (disaggregated.second_token_gap["p50"] - colocated.itl["p50"]) * 1e3
    target = 2 * copy_ms + 10
    return Check("second-token gap p50 (disaggregated) - ITL p50 (colocated), ms", added_ms, target,
                 added_ms <= target, at_most=True)


def plot_report(path: Path, runs: dict[str, list[list[RequestTiming]]], results: dict[str, SystemResult],
                title: str) -> None:
    """PNG of the TTFT, TPOT and inter-token latency distributions (CDFs, a line per
    system, every round pooled) and each system's output throughput. The curves show what
    the p50/p90/p99 table hides: a TTFT in two modes (queued or not), the long gaps a
    prefill puts between a decode's tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    samples = {name: latency_samples([t for timings in rounds for t in timings]) for name, rounds in runs.items()}
    for ax, metric, label, unit in zip(axes.flat, ("ttft", "tpot", "itl"),
                                       ("time to first token", "time per output token", "inter-token latency"),
                                       ("requests", "requests", "token gaps")):
        for name, values in samples.items():
            ms = np.sort(np.asarray(values[metric])) * 1e3
            if ms.size:  # HTTP dashed: beside gRPC on the same deployment
                ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=name,
                        linestyle="--" if name.endswith(HTTP_TWIN) or name.startswith("http://") else "-")
        ax.set_xscale("symlog", linthresh=1.0)  # ITLs of 0: replies of several tokens
        ax.set_xlabel("milliseconds")
        ax.set_ylabel(f"fraction of {unit} at most")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    names = list(results)
    bars = ax.bar(range(len(names)), [results[name].output_tokens_per_s for name in names])
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title("output throughput")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
