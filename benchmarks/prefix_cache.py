"""Prefix caching benchmark: a chat workload with a shared system prompt, and one with no
sharing at all, each with caching on and off, side by side in one run.

    shared   USERS users, each holding a conversation of TURNS turns with the same
             system prompt of SYSTEM tokens. A turn's prompt is the system prompt, the
             user's history (HISTORY tokens; none by default), the conversation so far
             (earlier messages and the answers the server gave) and a new message of
             MESSAGE tokens; the answer is ANSWER tokens. The users talk at
             once; each sends its next turn when the last one's answer is complete.
    unique   the same users, turns and prompt lengths, but every prompt is new random
             tokens: nothing to share, so caching can only cost.

Systems (`--systems`):

    engine          the in-process engine (AsyncEngine), caching on / off
                    (LLM(enable_prefix_caching=...))
    disaggregated   gateway + prefill worker + decode worker (separate processes, KV
                    handed over ipc), caching on / off in both workers (--no-prefix-caching)

With `--tier`, the comparison is the prefix cache's host tier (engine/kv/host_tier.py) against
the device cache alone, caching on in both, on two workloads of the shared kind (4 turns), in
the shape of LMCache's multi-round QA benchmark: each user's conversation starts with a
history of its own (HISTORY tokens, --history-tokens: 512; LMCache's example has 2,000 on a
GPU) after the shared system prompt:

    shared   the device cache sized to a quarter of the working set (the system prompt and
             every user's conversation), the host tier to all of it: targets throughput
             >= 2x and TTFT p50 >= 3x better with the tier
    fits     the device cache holds the whole working set: the tier must cost nothing
             (throughput >= 0.97x)

Reported per system and workload: output tokens/s, TTFT p50/p90, end-to-end p50, the
prompt tokens the server reported cached (usage.cached_tokens; "(host)": of all prompt tokens,
those a host tier gave back, usage.host_cached_tokens) and, disaggregated, the KV
bytes moved per request. Targets, caching on against off: shared throughput >= 2x and
TTFT p50 >= 3x better; unique throughput >= 0.97x; disaggregated, the bytes per request
fall by the shared fraction (the share of prompt tokens in blocks an earlier prompt
already had: KV bytes per request on / off <= (1 - shared fraction) + 5%).

    python -m benchmarks.prefix_cache                       # 64 users, 3 turns, 1000 shared tokens
    python -m benchmarks.prefix_cache --quick --systems engine
    python -m benchmarks.prefix_cache --tier --systems engine  # the host tier, 64 users x 4 turns
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

BLOCK_SIZE = 16  # the engine's default

# A turn: (prompt token ids) -> (output token ids, seconds to first token, cached prompt tokens,
# of them those a host tier held).
Serve = Callable[[str, list[int], int], Awaitable[tuple[list[int], float, int, int]]]


@dataclass(frozen=True)
class ChatShape:
    users: int = 64
    turns: int = 3
    system_tokens: int = 1000
    message_tokens: int = 48
    answer_tokens: int = 32
    seed: int = 0
    history_tokens: int = 0  # each user's own context at the start of its conversation
    min_token_id: int = 100
    vocab_size: int = 49152


@dataclass
class RunResult:
    system: str
    workload: str
    caching: bool
    seconds: float
    num_requests: int
    num_output_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_host_cached_tokens: int = 0  # of them, those the host tier held (usage.host_cached_tokens)
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    kv_bytes: int | None = None
    num_transfers: int | None = None  # handoffs that moved blocks (one that reused all moves none)
    num_received_blocks: int | None = None  # prompt blocks of handed-off requests (decode)
    num_reused_blocks: int | None = None  # of them, found in the decode worker's prefix cache

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds

    def summary(self) -> dict:
        data = asdict(self)
        del data["ttft"], data["e2e"]
        data.update(
            output_tokens_per_s=self.output_tokens_per_s,
            ttft_p50=float(np.percentile(self.ttft, 50)), ttft_p90=float(np.percentile(self.ttft, 90)),
            e2e_p50=float(np.percentile(self.e2e, 50)),
            cached_fraction=self.num_cached_tokens / max(self.num_prompt_tokens, 1),
            host_cached_fraction=self.num_host_cached_tokens / max(self.num_prompt_tokens, 1),
            kv_bytes_per_request=None if self.kv_bytes is None else self.kv_bytes / self.num_requests,
            reused_block_fraction=(None if not self.num_received_blocks
                                   else self.num_reused_blocks / self.num_received_blocks),
        )
        return data


class Conversations:
    """The users' messages, fixed by the seed; a turn's prompt also holds the answers given."""

    def __init__(self, shape: ChatShape, workload: str) -> None:
        self.shape, self.workload = shape, workload
        rng = np.random.default_rng(shape.seed)

        def tokens(n: int) -> list[int]:
            return rng.integers(shape.min_token_id, shape.vocab_size, n).tolist()

        self.system = tokens(shape.system_tokens)
        self.histories = [tokens(shape.history_tokens) for _ in range(shape.users)]
        self.messages = [[tokens(shape.message_tokens) for _ in range(shape.turns)] for _ in range(shape.users)]
        self._fresh = np.random.default_rng(shape.seed + 1)

    def prompt(self, user: int, turn: int, history: list[int]) -> list[int]:
        """The prompt of `user`'s turn: shared, the system prompt, the history and the new
        message; unique, as many tokens, all new."""
        prompt = [*self.system, *self.histories[user], *history, *self.messages[user][turn]]
        if self.workload == "unique":
            shape = self.shape
            return self._fresh.integers(shape.min_token_id, shape.vocab_size, len(prompt)).tolist()
        return prompt


def working_set_blocks(shape: ChatShape, block_size: int) -> int:
    """Blocks that hold the system prompt once and every user's whole conversation."""
    conversation = shape.history_tokens + shape.turns * (shape.message_tokens + shape.answer_tokens)
    return -(-shape.system_tokens // block_size) + shape.users * -(-conversation // block_size)


def tier_cache_sizes(shape: ChatShape, workload: str, tier_on: bool) -> dict:
    """--tier: the device cache (a quarter of the working set, or all of it and a margin
    when it `fits`) and the host tier (the working set twice over; none when off)."""
    working_set = working_set_blocks(shape, BLOCK_SIZE)
    longest = working_set_blocks(replace(shape, users=1), BLOCK_SIZE)  # one user's whole conversation
    # A quarter, but room for two of the longest requests at least (a small --quick shape).
    device = max(working_set // 4, 2 * longest) if workload == "shared" else working_set * 5 // 4
    return {"num_kv_blocks": device, "num_offload_blocks": 2 * working_set if tier_on else 0}


def shared_fraction(prompts: list[list[int]], block_size: int) -> float:
    """Share of all prompt tokens in full blocks that an earlier prompt began with alike:
    what an unbounded prefix cache would not compute (or move) again."""
    from engine.kv.prefix_hash import block_hashes

    seen: set[bytes] = set()
    shared = total = 0
    for prompt in prompts:
        hashes = block_hashes(prompt, block_size)
        matched = 0
        while matched < len(hashes) and hashes[matched] in seen:
            matched += 1
        shared += matched * block_size
        total += len(prompt)
        seen.update(hashes)
    return shared / total if total else 0.0


async def run_conversations(conversations: Conversations, serve: Serve) -> tuple[RunResult, list[list[int]]]:
    """Every user's turns, users at once, turns one after the other; the prompts sent, in
    the order they were sent."""
    shape = conversations.shape
    result = RunResult("", conversations.workload, False, 0.0, 0, 0, 0, 0)
    sent: list[list[int]] = []

    async def user(index: int) -> None:
        history: list[int] = []
        for turn in range(shape.turns):
            prompt = conversations.prompt(index, turn, history)
            sent.append(prompt)
            started = time.perf_counter()
            output, ttft, cached, host_cached = await serve(f"u{index}-t{turn}", prompt, shape.answer_tokens)
            result.e2e.append(time.perf_counter() - started)
            result.ttft.append(ttft)
            result.num_requests += 1
            result.num_output_tokens += len(output)
            result.num_prompt_tokens += len(prompt)
            result.num_cached_tokens += cached
            result.num_host_cached_tokens += host_cached
            history += [*conversations.messages[index][turn], *output]

    started = time.perf_counter()
    await asyncio.gather(*(user(i) for i in range(shape.users)))
    result.seconds = time.perf_counter() - started
    return result, sent


# ----------------------------------------------------------------------- systems
def run_engine(args, conversations: Conversations, caching: bool) -> tuple[RunResult, list[list[int]]]:
    from baton.runtime.worker import build_engine
    from engine.async_engine import AsyncEngine
    from engine.config import engine_config
    from engine.envs import configure_process
    from engine.sampling_params import SamplingParams

    configure_process(args.threads)
    sizes = tier_cache_sizes(conversations.shape, conversations.workload, caching) if args.tier else _cache_size(args)
    llm = build_engine(engine_config(args.model, max_num_batched_tokens=args.max_num_batched_tokens,
                                     enable_prefix_caching=caching or args.tier, **sizes))

    async def drive() -> tuple[RunResult, list[list[int]]]:
        engine = AsyncEngine(llm)
        engine.start()

        async def serve(request_id: str, prompt: list[int], max_tokens: int):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            started = time.perf_counter()
            ttft, output, cached, host_cached = None, [], 0, 0
            async for out in await engine.add_request(request_id, prompt, params):
                if ttft is None:
                    ttft = time.perf_counter() - started
                output += out.new_token_ids
                if out.finished:
                    cached, host_cached = out.num_cached_tokens or 0, out.num_host_cached_tokens
            return output, ttft, cached, host_cached

        try:
            return await run_conversations(conversations, serve)
        finally:
            await engine.stop()

    return asyncio.run(drive())


def run_disaggregated(args, conversations: Conversations, caching: bool,
                      log_dir: Path) -> tuple[RunResult, list[list[int]]]:
    import grpc

    from baton.cli.local import start_deployment
    from baton.wire.v1 import generation_pb2 as pb
    from baton.wire.v1 import generation_pb2_grpc

    worker_args = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.tier:  # the host tier in bytes: SmolLM2's float32 block is 0.7 MB
        sizes = tier_cache_sizes(conversations.shape, conversations.workload, caching)
        worker_args += ["--num-kv-blocks", str(sizes["num_kv_blocks"]),
                        "--kv-offload-memory", f"{sizes['num_offload_blocks'] * 2**20}B"]
    elif args.num_kv_blocks:
        worker_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if not caching and not args.tier:
        worker_args.append("--no-prefix-caching")
    deployment = start_deployment(
        args.model, log_dir / f"disaggregated-{'on' if caching else 'off'}-{conversations.workload}",
        worker_args=worker_args,
        prefill_args=["--threads", str(args.prefill_threads)], decode_args=["--threads", str(args.decode_threads)],
        # Every prompt is handed off (none kept on the decode worker when the prefill queue is
        # long), so that KV bytes per request compare like with like; every request is served
        # (no admission bound); a step of 2048 prompt tokens takes seconds on a few CPU cores,
        # which the default stall timeout would take for a hang.
        gateway_args=["--max-prefill-queue-tokens", "0", "--max-queued-tokens", str(1 << 30),
                      "--stall-timeout-s", "60"],
        threads=args.decode_threads, timeout_s=900,
        env={"OTEL_SDK_DISABLED": "true"},
    )
    try:
        async def drive() -> tuple[RunResult, list[list[int]]]:
            async with grpc.aio.insecure_channel(deployment.gateway) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)

                async def serve(request_id: str, prompt: list[int], max_tokens: int):
                    message = pb.GenerateRequest(
                        request_id=request_id, token_ids=pb.TokenIds(ids=prompt),
                        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                    started = time.perf_counter()
                    ttft, output, usage = None, [], pb.Usage()
                    async for reply in stub.GenerateStream(message, timeout=3600):
                        if ttft is None and reply.token_ids:
                            ttft = time.perf_counter() - started
                        output += reply.token_ids
                        if reply.HasField("usage"):
                            usage = reply.usage
                    return output, ttft, usage.cached_tokens, usage.host_cached_tokens

                return await run_conversations(conversations, serve)

        result, sent = asyncio.run(drive())
        decode = deployment.stats("decode")
        result.kv_bytes, result.num_transfers = decode.num_transferred_bytes, decode.num_transfers
        result.num_reused_blocks = decode.prefix_cache_reused_blocks
        result.num_received_blocks = decode.prefix_cache_received_blocks
        deployment.wait_idle(60)
    finally:
        deployment.stop()
    return result, sent


def _cache_size(args) -> dict:
    return {"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}


# ------------------------------------------------------------------------ report
def ratios(results: dict[tuple[str, str, bool], RunResult], fractions: dict[str, float]) -> list[tuple]:
    """(what, value, target, met) for every target the run can check."""
    checks = []
    for system in sorted({key[0] for key in results}):
        def pair(workload: str):
            return results.get((system, workload, True)), results.get((system, workload, False))

        on, off = pair("shared")
        if on and off:
            throughput = on.output_tokens_per_s / off.output_tokens_per_s
            ttft = float(np.percentile(off.ttft, 50) / np.percentile(on.ttft, 50))
            checks += [(f"{system} shared: throughput on/off", throughput, 2.0, throughput >= 2.0),
                       (f"{system} shared: TTFT p50 off/on", ttft, 3.0, ttft >= 3.0)]
            if on.kv_bytes is not None and off.kv_bytes:
                ratio = (on.kv_bytes / on.num_requests) / (off.kv_bytes / off.num_requests)
                bound = 1 - fractions["shared"] + 0.05
                checks.append((f"{system} shared: KV bytes per request on/off (shared fraction "
                               f"{fractions['shared']:.2f})", ratio, bound, ratio <= bound))
        for workload in ("unique", "fits"):
            on, off = pair(workload)
            if on and off:
                throughput = on.output_tokens_per_s / off.output_tokens_per_s
                checks.append((f"{system} {workload}: throughput on/off", throughput, 0.97, throughput >= 0.97))
    return checks


def print_report(results: dict[tuple[str, str, bool], RunResult], checks: list[tuple], shape: ChatShape,
                 fractions: dict[str, float], tier: bool = False) -> None:
    print(f"\nchat: {shape.users} users x {shape.turns} turns, system prompt {shape.system_tokens} tokens, "
          f"each user's history {shape.history_tokens}, messages {shape.message_tokens}, answers "
          f"{shape.answer_tokens}; shared fraction of prompt tokens: "
          + ", ".join(f"{workload} {fraction:.2f}" for workload, fraction in fractions.items()))
    header = f"{'system':<14} {'workload':<8} {'cache':<5} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p90':>9} " \
             f"{'e2e p50':>8} {'cached':>7} {'(host)':>7} {'KV MB/req':>9}"
    print(header + ("   (cache on: with the host tier; off: the device cache alone)" if tier else ""))
    for (system, workload, caching), result in sorted(results.items(), key=lambda item: (item[0][0], item[0][1],
                                                                                         not item[0][2])):
        s = result.summary()
        kv = "" if s["kv_bytes_per_request"] is None else f"{s['kv_bytes_per_request'] / 1e6:.2f}"
        print(f"{system:<14} {workload:<8} {'on' if caching else 'off':<5} {s['output_tokens_per_s']:>8.1f} "
              f"{s['ttft_p50']:>8.3f}s {s['ttft_p90']:>8.3f}s {s['e2e_p50']:>7.2f}s {s['cached_fraction']:>7.0%} "
              f"{s['host_cached_fraction']:>7.0%} "
              f"{kv:>9}")
    print()
    for what, value, target, met in checks:
        comparison = "<=" if "bytes" in what else ">="
        print(f"  {what}: {value:.2f} (target {comparison} {target:.2f}) {'OK' if met else 'MISSED'}")
    print("  SGLang reports up to 5x throughput from prefix reuse (RadixAttention) on workloads of this kind.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--systems", default="engine,disaggregated")
    parser.add_argument("--workloads", default="shared,unique")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--turns", type=int, default=None, help="3; with --tier, 4")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--message-tokens", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--history-tokens", type=int, default=None,
                        help="each user's own context before its first message (LMCache's multi-round QA "
                             "'user history prompt'): 0; with --tier, 512")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per engine (default: by memory)")
    parser.add_argument("--threads", type=int, default=2, help="engine: torch threads")
    parser.add_argument("--prefill-threads", type=int, default=2)
    parser.add_argument("--decode-threads", type=int, default=2)
    parser.add_argument("--tier", action="store_true", help="the host tier on / off (caching on in both), on the "
                        "shared and fits workloads")
    parser.add_argument("--quick", action="store_true", help="a small run (8 users, 2 turns, 256 shared tokens)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the deployments' logs here")
    args = parser.parse_args(argv)
    args.turns = args.turns or (4 if args.tier else 3)
    if args.history_tokens is None:
        args.history_tokens = 512 if args.tier else 0
    if args.tier and args.workloads == "shared,unique":
        args.workloads = "shared,fits"
    if args.quick:
        args.users, args.turns, args.system_tokens, args.message_tokens, args.answer_tokens = 8, 2, 256, 16, 8
        args.history_tokens = min(args.history_tokens, 64)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)  # the prompts' tokens come from the model's vocabulary
    shape = ChatShape(args.users, args.turns, args.system_tokens, args.message_tokens, args.answer_tokens, args.seed,
                      args.history_tokens, vocab_size=len(tokenizer) if tokenizer is not None else 49152)
    systems = [s for s in args.systems.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(systems) - {"engine", "disaggregated"} | set(workloads) - {"shared", "unique", "fits"}
    if unknown:
        raise SystemExit(f"unknown systems or workloads: {', '.join(sorted(unknown))}")
    block_size = BLOCK_SIZE
    results: dict[tuple[str, str, bool], RunResult] = {}
    fractions: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="baton-prefix-bench-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        for system in systems:
            for workload in workloads:
                # Off first, then on: whatever warms up over a run favours the baseline.
                for caching in (False, True):
                    conversations = Conversations(shape, workload)
                    if system == "engine":
                        result, sent = run_engine(args, conversations, caching)
                    else:
                        result, sent = run_disaggregated(args, conversations, caching, log_dir)
                    result.system, result.caching = system, caching
                    results[(system, workload, caching)] = result
                    fractions.setdefault(workload, shared_fraction(sent, block_size))
                    arm = f"{'host tier' if args.tier else 'caching'} {'on' if caching else 'off'}"
                    print(f"{system} {workload} {arm}: "
                          f"{result.output_tokens_per_s:.1f} output tokens/s, "
                          f"TTFT p50 {np.percentile(result.ttft, 50):.3f} s", flush=True)
    checks = ratios(results, fractions)
    print_report(results, checks, shape, fractions, args.tier)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "shape": asdict(shape), "shared_fraction": fractions,
            "results": [result.summary() for result in results.values()],
            "checks": [{"what": w, "value": v, "target": t, "met": m} for w, v, t, m in checks],
        }, indent=2))
    return 0 if all(met for *_, met in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
