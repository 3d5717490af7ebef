"""`baton up`: a gateway, a prefill worker and a decode worker as child processes on
this machine, stopped together."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from baton.cli.local import start_deployment

STARTUP_TIMEOUT_S = 900.0


def up(args: argparse.Namespace) -> int:
    # Every worker may use every core: idle workers sleep (see start_deployment).
    threads = args.threads or max(1, len(os.sched_getaffinity(0)))
    worker_args = ["--kv-cache-memory", args.kv_cache_memory, "--log-level", args.log_level]
    if args.verify_kv:
        worker_args.append("--verify-kv")
    stopping = False

    def stop(signum=None, frame=None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        deployment = start_deployment(
            args.model,
            None,
            gateway_address=f"127.0.0.1:{args.port}",
            prefill=not args.colocated,
            worker_args=worker_args,
            threads=threads,
            timeout_s=STARTUP_TIMEOUT_S,
        )
    except (RuntimeError, TimeoutError) as error:
        print(f"baton up: {error}", file=sys.stderr)
        return 1
    gateway = deployment.gateway
    mode = "colocated" if args.colocated else "disaggregated"
    print(
        f"\nBaton is serving {args.model} ({mode}) at {gateway}\n"
        f"  baton generate --gateway {gateway} --chat \"What is the capital of France?\"\n"
        f"Ctrl-C stops it.\n",
        flush=True,
    )
    code = 0
    try:
        while not stopping:
            for process in deployment.processes:
                if process.popen.poll() is not None:
                    print(f"baton up: the {process.role} exited with code {process.popen.returncode}",
                          file=sys.stderr)
                    code, stopping = 1, True
            time.sleep(0.2)
    except KeyboardInterrupt:  # Ctrl-C reached the children too; they drain and exit
        pass
    codes = deployment.stop()
    return code or max(codes.values(), default=0)
