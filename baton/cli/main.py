"""The `baton` command: run a local deployment, one role per process, or a client call.

    baton up [--model M] [--port P]          gateway + prefill worker + decode worker
    baton gateway --decode-workers ADDR ...  one role per process
    baton prefill-worker --listen ADDR ...
    baton decode-worker --listen ADDR ...
    baton generate "prompt" [--stream] [--max-tokens N] [--chat] ...
    baton status [--gateway ADDR] [--queue-slo-ms MS] [--json]

Every flag of a server role also reads an environment variable (BATON_ plus
the flag's name in capitals, e.g. --max-num-seqs <- BATON_MAX_NUM_SEQS); a
flag given on the command line wins. This module is the only place that
reads them.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_GATEWAY = "127.0.0.1:50051"


def _env(name: str, default=None):
    return os.environ.get("BATON_" + name.upper().replace("-", "_"), default)


def _flag(parser: argparse.ArgumentParser, name: str, *, type=str, default=None, help: str) -> None:
    """A flag whose default comes from BATON_<NAME> when set."""
    env_value = _env(name)
    if env_value is not None:
        default = env_value if type is str else type(env_value)
    parser.add_argument(f"--{name}", type=type, default=default, help=f"{help} [env BATON_{name.upper().replace('-', '_')}]")


def _bool_flag(parser: argparse.ArgumentParser, name: str, help: str) -> None:
    env_value = _env(name)
    default = env_value is not None and env_value.lower() in ("1", "true", "yes", "on")
    parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default,
                        help=f"{help} [env BATON_{name.upper().replace('-', '_')}]")


def _size(text: str) -> int:
    """Bytes from '512M', '2G', '1048576'."""
    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "model", default="smollm2-135m",
          help="model: 'smollm2-135m', a Hugging Face model directory or a .gguf file")


def _add_worker_flags(parser: argparse.ArgumentParser, role: str) -> None:
    _flag(parser, "listen", default="127.0.0.1:0", help="address to listen on (port 0: any free port)")
    _flag(parser, "advertise", help="address peers reach this worker at (default: the listen address)")
    _flag(parser, "worker-id", help="worker id in stats, logs and KV handles (default: random)")
    _add_model_flags(parser)
    _flag(parser, "dtype", default="float32", help="float32, bfloat16 or float64")
    _flag(parser, "max-model-len", type=int, help="cap on prompt + output tokens")
    _flag(parser, "block-size", type=int, default=16, help="tokens per KV block")
    _flag(parser, "num-kv-blocks", type=int, help="KV blocks (default: from --kv-cache-memory)")
    _flag(parser, "kv-cache-memory", type=_size, default=_size("1G"), help="KV cache budget, e.g. 512M, 2G")
    _flag(parser, "max-num-seqs", type=int, default=256, help="sequences per step")
    _flag(parser, "preemption-mode", default="auto",
          help="auto (cheaper of recompute and swap, per sequence), recompute or swap")
    _flag(parser, "swap-space", type=_size, default=_size("256M"), help="CPU swap pool for swap preemption")
    _flag(parser, "max-num-batched-tokens", type=int, default=512 if role == "prefill" else 2048,
          help="token budget per step (prefill chunks + decodes)")
    _flag(parser, "threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads")
    _flag(parser, "attention-backend", default="auto", help="auto, torch or cpu")
    _flag(parser, "lease-s", type=float, default=30.0, help="prefill: seconds held KV waits to be pulled")
    _flag(parser, "transfer-timeout-s", type=float, default=30.0, help="timeout of each KV rendezvous and transfer")
    _bool_flag(parser, "verify-kv", help="checksum every transferred KV block on both sides")
    _flag(parser, "transfer-host", default="127.0.0.1", help="decode: host of the KV rendezvous store")
    _flag(parser, "grace-s", type=float, default=10.0, help="SIGTERM: seconds for in-flight requests")
    _flag(parser, "metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free one)")
    _flag(parser, "log-level", default="INFO", help="logging level")


def _worker_settings(args: argparse.Namespace, role: str):
    from baton.runtime.worker import WorkerSettings, engine_config

    config = engine_config(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=None if args.num_kv_blocks else args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
        attention_backend=args.attention_backend,
        preemption_mode=args.preemption_mode,
        swap_space_bytes=args.swap_space,
    )
    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    return WorkerSettings(
        role=role,
        listen=args.listen,
        advertise=args.advertise,
        engine=config,
        lease_s=args.lease_s,
        transfer_timeout_s=args.transfer_timeout_s,
        verify_kv=args.verify_kv,
        transfer_host=args.transfer_host,
        grace_s=args.grace_s,
        metrics_port=args.metrics_port,
        **extra,
    )


def _split(text: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving over gRPC")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run a gateway, a prefill worker and a decode worker here")
    _add_model_flags(up)
    _flag(up, "port", type=int, default=50051, help="gateway port")
    _flag(up, "threads", type=int, help="torch threads per worker (default: all cores each; an idle worker's threads sleep)")
    _flag(up, "kv-cache-memory", default="1G", help="KV cache budget per worker")
    _bool_flag(up, "verify-kv", help="checksum every transferred KV block on both sides")
    _bool_flag(up, "colocated", help="no prefill worker: the decode worker prefills")
    _flag(up, "log-level", default="INFO", help="logging level")

    gateway = commands.add_parser("gateway", help="run the public gateway")
    _flag(gateway, "listen", default=DEFAULT_GATEWAY, help="address to listen on")
    _flag(gateway, "prefill-workers", default="", help="comma-separated prefill worker addresses")
    _flag(gateway, "decode-workers", default="", help="comma-separated decode worker addresses")
    _add_model_flags(gateway)
    _flag(gateway, "startup-timeout-s", type=float, default=600.0, help="seconds to wait for a decode worker to serve before exiting with an error")
    _flag(gateway, "grace-s", type=float, default=10.0, help="SIGTERM: seconds for in-flight requests")
    _flag(gateway, "metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free one)")
    _flag(gateway, "max-local-prefill-tokens", type=int, default=0,
          help="prompts this short are prefilled on their decode worker (no handoff)")
    _flag(gateway, "max-prefill-queue-tokens", type=int, default=2048,
          help="above this many queued prefill tokens, prompts go to a decode worker with fewer queued "
               "(0: never)")
    _flag(gateway, "log-level", default="INFO", help="logging level")

    _add_worker_flags(commands.add_parser("prefill-worker", help="run a prefill worker"), "prefill")
    _add_worker_flags(commands.add_parser("decode-worker", help="run a decode worker"), "decode")

    generate = commands.add_parser("generate", help="send one request to a gateway")
    generate.add_argument("prompt", help="the prompt text")
    _flag(generate, "gateway", default=DEFAULT_GATEWAY, help="gateway address")
    generate.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    generate.add_argument("--stream", action="store_true", help="print text as it is generated")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--timeout-s", type=float, default=600.0)

    status = commands.add_parser("status", help="each worker's health, load and scheduling, with findings")
    _flag(status, "gateway", default=DEFAULT_GATEWAY, help="gateway address")
    status.add_argument("--queue-slo-ms", type=float, default=1000.0,
                        help="report mean queue times (arrival to admission) above this")
    status.add_argument("--json", action="store_true", help="print the status and findings as JSON")
    status.add_argument("--timeout-s", type=float, default=10.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        from baton.cli.client import generate_command

        return generate_command(args)
    if args.command == "status":
        from baton.cli.status import status_command

        return status_command(args)
    from baton.runtime.server import configure_logging

    configure_logging(args.log_level)
    if args.command == "up":
        from baton.cli.launcher import up

        return up(args)
    if args.command == "gateway":
        from gateway.server import GatewaySettings, serve
        from gateway.workers import RoutingPolicy

        serve(
            GatewaySettings(
                listen=args.listen,
                prefill_workers=_split(args.prefill_workers),
                decode_workers=_split(args.decode_workers),
                model=args.model,
                startup_timeout_s=args.startup_timeout_s,
                grace_s=args.grace_s,
                metrics_port=args.metrics_port,
                routing=RoutingPolicy(
                    max_local_prefill_tokens=args.max_local_prefill_tokens,
                    max_prefill_queue_tokens=args.max_prefill_queue_tokens,
                ),
            )
        )
        return 0
    role = "prefill" if args.command == "prefill-worker" else "decode"
    settings = _worker_settings(args, role)
    if role == "prefill":
        from prefill_worker.server import serve
    else:
        from decode_worker.server import serve
    serve(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
