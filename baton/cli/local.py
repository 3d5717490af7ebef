"""A local Baton deployment: a gateway, prefill workers and decode workers as child
processes on loopback. `baton up`, the end-to-end tests and the serving benchmark start it."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.runtime.clients import GatewayAdminClient, worker_stats
from baton.runtime.security import TlsConfig
from baton.runtime.server import open_blocking_channel
from baton.runtime.settings import ADMIN_ON_PUBLIC_PORT, child_environment
from baton.runtime.values import format_cpu_list
from baton.wire.records import WorkerStats

REPO_ROOT = Path(__file__).resolve().parents[2]


# Ports are chosen below the kernel's ephemeral range (net.ipv4.ip_local_port_range, whose
# Linux default starts at 32768): a port the kernel picked from that range (bind to port 0)
# may be taken as an outgoing connection's source port before the process it was picked
# for binds it, and that process then dies with "Address already in use".
LOWEST_PORT = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now, at random below the ephemeral range (the
    kernel's choice when that range starts too low to leave room), and not one this
    process was given before: the ports of a deployment are picked before any is bound,
    so two picks of one port would start a process that cannot listen (a gateway whose
    --admin-listen was its --listen refused to start)."""
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    pick = random.SystemRandom()
    for _ in range(100):
        if ephemeral_low - LOWEST_PORT >= 1000:
            port = pick.randrange(LOWEST_PORT, ephemeral_low)
        else:
            port = 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port
    raise OSError("no free TCP port on 127.0.0.1 in 100 tries")


_GIVEN_PORTS: set[int] = set()


@dataclass
class Process:
    role: str
    address: str
    popen: subprocess.Popen
    log_path: Path | None  # None: output goes to this process's stdout
    metrics_port: int | None = None  # its Prometheus endpoint, when it serves one

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")


@dataclass
class Deployment:
    """Running processes; `gateway` is the public address, `admin` GatewayAdmin's.
    `tls` and `api_key` are how this process calls them (TLS: its certificate is one
    the deployment's CA signed, so it passes the workers' mTLS)."""

    gateway: str
    processes: list[Process] = field(default_factory=list)
    _env: dict[str, str] | None = None  # the processes' environment
    admin: str = ""  # the gateway's --admin-listen, or `gateway` (--admin-listen public)
    tls: TlsConfig | None = None
    api_key: str | None = None
    http: str = ""  # host:port of the gateway's OpenAI HTTP API ("": not served)

    def __post_init__(self) -> None:
        self.admin = self.admin or self.gateway

    def worker(self, role: str) -> Process:
        return next(p for p in self.processes if p.role == role)

    def channel(self, address: str) -> grpc.Channel:
        """A blocking channel to one of the processes, over TLS if they serve it."""
        return open_blocking_channel(address, self.tls)

    def admin_client(self, channel: grpc.Channel) -> GatewayAdminClient:
        return GatewayAdminClient(channel, self.api_key)

    def workers(self, role: str) -> list[Process]:
        return [p for p in self.processes if p.role == role]

    def stats(self, role: str | Process) -> WorkerStats:
        """A worker's stats: the first of `role`'s, or this process's."""
        process = self.worker(role) if isinstance(role, str) else role
        with self.channel(process.address) as channel:
            return worker_stats(channel, process.role, timeout=10)

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, WorkerStats]:
        """Wait until no worker uses a KV block, runs or queues a request, or has a KV
        handoff pending (blocks held under a lease, or arriving); returns every worker's
        stats then, by worker id. Raises TimeoutError naming what each still holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = {s.worker_id: s for s in (self.stats(p) for p in self.processes if p.role != "gateway")}
            held = {worker_id: what for worker_id, s in stats.items() if (what := _held(s))}
            if not held:
                return stats
            if time.monotonic() > deadline:
                held_text = "; ".join(f"{worker_id}: {what}" for worker_id, what in held.items())
                raise TimeoutError(f"workers still hold work after {timeout_s} s: {held_text}\n{self.logs()}")
            time.sleep(0.05)

    def restart(self, process: Process, timeout_s: float = 300.0) -> Process:
        """Start `process` again, on its address with its arguments (after it exited or
        was killed), and wait until it serves and the gateway routes to it."""
        if process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait()
        log_path = None if process.log_path is None else process.log_path.with_suffix(".restarted.log")
        log = None if log_path is None else open(log_path, "w")
        popen = subprocess.Popen(process.popen.args, stdout=log, stderr=None if log is None else subprocess.STDOUT,
                                 env=self._env)
        restarted = Process(process.role, process.address, popen, log_path, process.metrics_port)
        self.processes[self.processes.index(process)] = restarted
        wait_serving(restarted.address, self, timeout_s)
        wait_in_rotation(self.admin, self, timeout_s)
        return restarted

    def logs(self) -> str:
        return "\n".join(f"----- {p.role} ({p.address}) -----\n{p.log()[-6000:]}" for p in self.processes)

    def stop(self, timeout_s: float = 30.0) -> dict[str, int]:
        """SIGTERM everything (gateway first); returns each role's exit code."""
        for process in reversed(self.processes):
            if process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
        codes = {}
        for process in reversed(self.processes):
            key = process.role if process.role not in codes else f"{process.role} {process.address}"
            try:
                codes[key] = process.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.popen.kill()
                codes[key] = process.popen.wait()
        return codes


def _held(stats: WorkerStats) -> str:
    """What a worker still holds, in words ("" when nothing)."""
    counts = (("KV blocks used", stats.num_kv_blocks_used), ("running", stats.num_running),
              ("waiting", stats.num_waiting), ("KV handoffs pending", stats.num_kv_handoffs_pending))
    return ", ".join(f"{num} {what}" for what, num in counts if num)


def spawn(role: str, args: list[str], log_dir: Path | None, env: dict[str, str], name: str | None = None,
          wrap: Callable[[list[str]], list[str]] = lambda argv: argv) -> Process:
    """Start `baton <args>` (`wrap` may run it elsewhere: another network namespace)."""
    log_path = None if log_dir is None else log_dir / f"{name or role}.log"
    log = None if log_path is None else open(log_path, "w")
    popen = subprocess.Popen(
        wrap([sys.executable, "-m", "baton.cli", *args]),
        stdout=log,
        stderr=None if log is None else subprocess.STDOUT,
        env=env,
    )
    address = args[args.index("--listen") + 1]
    # The last --metrics-port, as argparse reads it (a caller's own may follow a default).
    ports = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--metrics-port"]
    metrics_port = int(ports[-1]) if ports else None
    return Process(role, address, popen, log_path, metrics_port)


def split_cpus(cpus: list[int], prefill: bool, num_decode: int = 1,
               num_prefill: int = 1) -> tuple[list[int], list[list[int]]]:
    """The prefill workers' cores (half of `cpus`, and at least one per prefill worker:
    `divide_cpus` shares them out) and each decode worker's (the rest, divided between
    them; all of `cpus` without a prefill worker). Split by CPU id: on a host with SMT,
    where a core's two threads may have distant ids, give each worker --cpus of its own
    instead."""
    num_prefill = num_prefill if prefill else 0
    if len(cpus) < num_prefill + num_decode:
        raise ValueError(f"splitting the cores takes at least {num_prefill + num_decode} of them; "
                         f"there are {len(cpus)}")
    # Few cores, many decode workers: one core each, the prefill workers the rest.
    size = min(max(len(cpus) // 2, num_prefill), len(cpus) - num_decode) if num_prefill else 0
    return cpus[:size], divide_cpus(cpus[size:], num_decode)


def divide_cpus(cpus: list[int], num_parts: int) -> list[list[int]]:
    """`cpus` in `num_parts` runs of consecutive ids, the first ones a core longer where
    they do not divide evenly."""
    if len(cpus) < num_parts:
        raise ValueError(f"{num_parts} workers need a core each; there are {len(cpus)}")
    size, extra = divmod(len(cpus), num_parts)
    bounds = [i * size + min(i, extra) for i in range(num_parts + 1)]
    return [cpus[bounds[i]:bounds[i + 1]] for i in range(num_parts)]


def wait_serving(address: str, deployment: Deployment, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with deployment.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            for process in deployment.processes:
                if process.popen.poll() is not None:
                    raise RuntimeError(f"{process.role} exited early\n{deployment.logs()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout_s} s\n{deployment.logs()}")


def wait_in_rotation(admin: str, deployment: Deployment, timeout_s: float) -> None:
    """Wait until the gateway (its GatewayAdmin at `admin`) routes to every worker it
    was given. A gateway serves once one decode worker is up; a worker that finished
    loading after that joins at the gateway's next poll, and a test or benchmark must
    not run before then."""
    deadline = time.monotonic() + timeout_s
    with deployment.channel(admin) as channel:
        client = deployment.admin_client(channel)
        while time.monotonic() < deadline:
            status = client.get_deployment_status(timeout=10)
            if all(worker.in_rotation for worker in status.workers):
                return
            time.sleep(0.1)
    raise TimeoutError(f"the gateway did not route to every worker within {timeout_s} s\n{deployment.logs()}")


def start_deployment(
    model: str,
    log_dir: Path | None,
    *,
    gateway_address: str | None = None,
    prefill: bool = True,
    num_prefill: int = 1,
    prefill_address: str | None = None,
    num_decode: int = 1,
    worker_args: list[str] = (),
    prefill_args: list[str] = (),
    decode_args: list[str] = (),
    gateway_args: list[str] = (),
    metrics: bool = False,
    threads: int = 1,
    split_cores: bool = False,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    admin_address: str = "auto",
    tls: TlsConfig | None = None,
    api_key: str | None = None,
    stagger: bool = False,
    http_port: int | None = None,
) -> Deployment:
    """Start the processes (logs to `log_dir`, or to our stdout when None) and wait
    until the gateway and every worker are SERVING. `prefill`: `num_prefill` prefill
    workers hand the prompts' KV to the `num_decode` decode workers; False: none, the
    decode workers prefill (colocated). `metrics`: each serves Prometheus
    metrics on a free port of its own (`Process.metrics_port`). `env`: extra environment
    variables of the processes, over ours (e.g. OTEL_EXPORTER_OTLP_ENDPOINT).
    `admin_address`: the gateway serves GatewayAdmin there (default "auto": a free port;
    "public", ADMIN_ON_PUBLIC_PORT: on the gateway's public port).
    `tls`, `api_key`: how we reach the processes, when the caller's args (the
    --tls-* flags to every role, --api-key-file or BATON_API_KEY to the gateway) secure them.
    The decode workers accept KV handles from the prefill workers only (the first one's
    address is `prefill_address`, default a free port; their --allowed-prefill-workers,
    which `decode_args` may override).
    `split_cores`: the prefill workers are bound to the first half of our cores and the
    decode workers to the rest (--cpus), each role's cores divided between its workers,
    each with a thread per core, as if each worker had a host of its own; otherwise every
    worker may use every core, with `threads`.
    `http_port`: the gateway serves the OpenAI HTTP API there (0: a free port), `Deployment.http`.
    `stagger`: each worker starts once the one before it serves, the prefill workers
    first (workers sharing a GPU: each sizes its KV cache from the memory the ones before
    it left)."""

    def metrics_args() -> list[str]:
        return ["--metrics-port", str(free_port())] if metrics else []

    if num_decode < 1 or (prefill and num_prefill < 1):
        raise ValueError(f"a deployment needs a decode worker and, unless colocated, a prefill worker "
                         f"(num_decode={num_decode}, num_prefill={num_prefill})")
    num_prefill = num_prefill if prefill else 0
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    env = child_environment({"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **(env or {})})
    # The processes share this machine's cores. With OpenMP's passive wait a worker
    # with nothing to do sleeps instead of spinning its threads, so the cores go to
    # whichever worker has work: the prefill workers during a burst of prompts, the
    # decode workers in between (benchmarks/serving.py measures the split).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    prefill_cores = [["--threads", str(threads)]] * num_prefill
    decode_cores = [["--threads", str(threads)]] * num_decode
    if split_cores:
        prefill_part, decode_parts = split_cpus(sorted(os.sched_getaffinity(0)), prefill, num_decode, num_prefill)
        prefill_parts = divide_cpus(prefill_part, num_prefill) if num_prefill else []
        prefill_cores = [["--cpus", format_cpu_list(part), "--threads", str(len(part))] for part in prefill_parts]
        decode_cores = [["--cpus", format_cpu_list(part), "--threads", str(len(part))] for part in decode_parts]
    common = ["--model", model, *worker_args]
    prefill_addresses = [f"127.0.0.1:{free_port()}" for _ in range(num_prefill)]
    if prefill_address is not None and prefill_addresses:
        prefill_addresses[0] = prefill_address
    decode_addresses = [f"127.0.0.1:{free_port()}" for _ in range(num_decode)]
    gateway_address = gateway_address or f"127.0.0.1:{free_port()}"
    if admin_address == "auto":
        admin_address = f"127.0.0.1:{free_port()}"
    admin = "" if admin_address == ADMIN_ON_PUBLIC_PORT else admin_address
    deployment = Deployment(gateway_address, _env=env, admin=admin, tls=tls, api_key=api_key)
    gateway_args = ["gateway", "--listen", gateway_address, "--model", model,
                    "--decode-workers", ",".join(decode_addresses), *metrics_args(), "--admin-listen",
                    admin_address, *gateway_args]
    if http_port is not None:
        deployment.http = f"127.0.0.1:{http_port or free_port()}"
        gateway_args += ["--http-port", deployment.http.rsplit(":", 1)[1]]
    kv_peers = []  # the decode workers' --allowed-prefill-workers
    if prefill_addresses:
        gateway_args += ["--prefill-workers", ",".join(prefill_addresses)]
        kv_peers = ["--allowed-prefill-workers", ",".join(prefill_addresses)]

    def start(role: str, index: int, args: list[str]) -> None:
        # The first of a role's logs is `role`.log, the others `role`-<index>.log.
        deployment.processes.append(spawn(role, args, log_dir, env, f"{role}-{index}" if index else role))
        if stagger:
            wait_serving(deployment.processes[-1].address, deployment, timeout_s)

    try:
        for i, address in enumerate(prefill_addresses):
            start("prefill", i, ["prefill-worker", "--listen", address, "--worker-id", f"prefill-{i}",
                                 *prefill_cores[i], *common, *metrics_args(), *prefill_args])
        for i, address in enumerate(decode_addresses):
            start("decode", i, ["decode-worker", "--listen", address, "--worker-id", f"decode-{i}", *kv_peers,
                                *decode_cores[i], *common, *metrics_args(), *decode_args])
        deployment.processes.append(spawn("gateway", gateway_args, log_dir, env))
        wait_serving(gateway_address, deployment, timeout_s)
        for process in deployment.processes[:-1]:
            wait_serving(process.address, deployment, timeout_s)
        wait_in_rotation(deployment.admin, deployment, timeout_s)
    except BaseException:
        deployment.stop()
        raise
    return deployment
