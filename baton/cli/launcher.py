"""`baton up`: a gateway, a prefill worker and a decode worker (or as many of each as
`--num-prefill-workers` and `--num-decode-workers` say) as child processes on this
machine, stopped together.

On CPU the workers share the cores. On CUDA they share one GPU (`--device cuda`), its
memory split between the roles by `--prefill-memory-fraction`, or each role has its own
(`--devices 0,1`); a role's workers on one GPU divide its part of it. Either way they are
on one host, so KV moves over ipc unless `--kv-transport` says otherwise.
`--speculative ngram` (and `--num-speculative-tokens`) reaches the decode workers only:
the prefill workers' rows only prefill, so they have nothing to speculate on."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from baton.cli.local import Deployment, free_port, start_deployment
from baton.cli.preflight import check_model
from baton.runtime.logs import LOG_FORMATS, configure_logging
from baton.runtime.security import TlsConfig
from baton.runtime.settings import (
    API_KEY_FILE_HELP,
    API_KEY_HELP,
    DEFAULT_GATEWAY_ADDRESS,
    DEFAULT_HTTP_PORT,
    DEVICE_CHOICES,
    DEVICE_HELP,
    DRAFT_MODEL_HELP,
    DTYPE_CHOICES,
    DTYPE_HELP,
    GPU_MEMORY_UTILIZATION_HELP,
    KV_CACHE_MEMORY_SHOWN,
    KV_OFFLOAD_MEMORY_HELP,
    LOG_FORMAT_HELP,
    LOG_LEVELS,
    MODEL_HELP,
    NUM_SPECULATIVE_TOKENS_HELP,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
    REVISION_HELP,
    SPECULATIVE_CHOICES,
    SPECULATIVE_HELP,
    TLS_CA_HELP,
    TLS_CERT_HELP,
    TLS_KEY_HELP,
    TLS_SERVER_NAME_HELP,
    TOKENIZER_HELP,
    SettingsError,
    default_of,
    from_args,
    kv_transport_setting,
    load_api_key,
    load_tls,
    setting,
)
from baton.runtime.values import format_size, parse_list
from engine.config import (
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    SpeculativeConfig,
    device_type,
)
from kvtransfer.endpoint import IPC

STARTUP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class UpSettings:
    """`baton up`: what to serve and how the local workers are sized; the rest of each
    role's settings are its defaults (or its BATON_* variables)."""

    model: str = setting(DEFAULT_MODEL, MODEL_HELP)
    revision: str | None = setting(None, REVISION_HELP, shown="main")
    tokenizer: str | None = setting(None, TOKENIZER_HELP, shown="--model's")
    device: str = setting(default_of(EngineConfig, "device"), DEVICE_HELP, choices=DEVICE_CHOICES)
    dtype: str = setting(default_of(EngineConfig, "dtype"), DTYPE_HELP, choices=DTYPE_CHOICES)
    quantization: str | None = setting(None, QUANTIZATION_HELP, choices=QUANTIZATION_CHOICES, shown="the checkpoint's")
    gpu_memory_utilization: float = setting(default_of(CacheConfig, "gpu_memory_utilization"),
                                            GPU_MEMORY_UTILIZATION_HELP)
    port: int = setting(int(DEFAULT_GATEWAY_ADDRESS.rsplit(":", 1)[1]), "gateway port")
    http_port: int = setting(DEFAULT_HTTP_PORT, "the gateway's OpenAI HTTP API port (0: none)")
    served_model_name: str | None = setting(None, "the model id the HTTP API shows and requests must name",
                                            shown="--model")
    threads: int | None = setting(None, "torch threads per worker",
                                  shown="all cores each; an idle worker's threads sleep")
    kv_cache_memory: int | None = setting(None, "KV cache budget per worker", size="B", shown=KV_CACHE_MEMORY_SHOWN)
    max_model_len: int | None = setting(None, "cap on prompt + output tokens, in both workers", shown="the model's")
    verify_kv: bool = setting(False, "checksum every transferred KV block on both sides")
    prefix_caching: bool = setting(default_of(CacheConfig, "enable_prefix_caching"),
                                   "share the KV of prompts that start alike, in both workers "
                                   "(--no-prefix-caching: off)")
    kv_offload_memory: int = setting(default_of(CacheConfig, "kv_offload_bytes"),
                                     KV_OFFLOAD_MEMORY_HELP + ", per worker", size="GiB", shown="0: off")
    kv_transport: str = kv_transport_setting()
    speculative: str | None = setting(None, SPECULATIVE_HELP, choices=SPECULATIVE_CHOICES, shown="off")
    num_speculative_tokens: int = setting(default_of(SpeculativeConfig, "num_speculative_tokens"),
                                          NUM_SPECULATIVE_TOKENS_HELP)
    draft_model: str | None = setting(None, DRAFT_MODEL_HELP, shown="none")
    colocated: bool = setting(False, "no prefill worker: the decode workers prefill")
    num_prefill_workers: int = setting(1, "prefill workers (none with --colocated)")
    num_decode_workers: int = setting(1, "decode workers")
    devices: tuple[str, ...] = setting((), "CUDA: the prefill workers' GPU and the decode workers', e.g. 0,1",
                                       parse=parse_list, shown="all on --device")
    prefill_memory_fraction: float = setting(0.4, "workers sharing one GPU: the prefill workers' share of "
                                                  "--gpu-memory-utilization (the decode workers have the rest)")
    split_cores: bool = setting(False, "bind the prefill workers to half the cores and the decode workers to "
                                       "the other half, each role's divided between its workers, as if each "
                                       "had a host of its own (--threads is then one per core)",
                                shown="off: every worker may use every core")
    log_level: str = setting("INFO", "logging level", choices=LOG_LEVELS)
    log_format: str = setting("text", LOG_FORMAT_HELP, choices=LOG_FORMATS)
    metrics_port: int | None = setting(None, "serve the gateway's Prometheus metrics on this port (0: any free "
                                             "one); each worker then serves its own on a free port, all listed "
                                             "at startup", shown="off")
    # Security: passed to every role (the API key to the gateway only).
    admin_port: int | None = setting(None, "serve GatewayAdmin (baton status) on this port of 127.0.0.1, never "
                                           "on the gateway's public port", shown="a free port")
    api_key: str | None = setting(None, API_KEY_HELP, shown="none, open", secret=True)
    api_key_file: str | None = setting(None, API_KEY_FILE_HELP)
    tls_cert: str | None = setting(None, TLS_CERT_HELP, shown="plaintext")
    tls_key: str | None = setting(None, TLS_KEY_HELP)
    tls_ca: str | None = setting(None, TLS_CA_HELP, shown="no client certificates")
    tls_server_name: str | None = setting(None, TLS_SERVER_NAME_HELP, shown="the host dialled")
    # Read on construction, so a missing file fails here, before any process starts.
    tls: TlsConfig | None = field(init=False, repr=False, compare=False)
    bearer_key: str | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tls", load_tls(self))
        object.__setattr__(self, "bearer_key", load_api_key(self.api_key, self.api_key_file))
        if self.speculative == "none":
            object.__setattr__(self, "speculative", None)
        if self.num_speculative_tokens <= 0:
            raise SettingsError("--num-speculative-tokens must be positive")
        if self.num_prefill_workers < 1 or self.num_decode_workers < 1:
            raise SettingsError("--num-prefill-workers and --num-decode-workers must be at least 1")
        if self.colocated and self.num_prefill_workers != 1:
            raise SettingsError("--colocated runs no prefill worker: drop --num-prefill-workers")
        num_workers = self.num_prefill + self.num_decode_workers
        if self.split_cores and len(os.sched_getaffinity(0)) < max(num_workers, 2):
            raise SettingsError(f"--split-cores needs at least {max(num_workers, 2)} cores, one per worker")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise SettingsError("--max-model-len must be positive")
        if not 0.0 < self.prefill_memory_fraction < 1.0:
            raise SettingsError("--prefill-memory-fraction must lie in (0, 1)")
        if self.devices:
            if len(self.devices) != 2 or not all(index.isdigit() for index in self.devices):
                raise SettingsError("--devices takes two GPU indices: the prefill workers' and the decode workers'")
            if device_type(self.device) != "cuda":
                raise SettingsError("--devices needs --device cuda")

    @property
    def num_prefill(self) -> int:
        """The prefill workers `baton up` starts: none when colocated."""
        return 0 if self.colocated else self.num_prefill_workers

    @property
    def has_gpu_per_role(self) -> bool:
        """--devices names two GPUs: the prefill workers on one, the decode workers on the other."""
        return len(set(self.devices)) == 2

    @property
    def shares_a_gpu(self) -> bool:
        """Two workers or more on one GPU: each takes its share of --gpu-memory-utilization."""
        if device_type(self.device) != "cuda":
            return False
        if self.has_gpu_per_role:
            return self.num_prefill > 1 or self.num_decode_workers > 1
        return self.num_prefill + self.num_decode_workers > 1

    def worker_devices(self) -> tuple[str, str]:
        """The prefill workers' device and the decode workers'."""
        if self.devices:
            return f"cuda:{self.devices[0]}", f"cuda:{self.devices[1]}"
        return self.device, self.device

    def gpu_memory_shares(self) -> tuple[float, float]:
        """Each prefill worker's --gpu-memory-utilization and each decode worker's, for
        workers sharing a GPU: a role's part of its GPU (all of it with a GPU per role, else
        --prefill-memory-fraction of it the prefill workers', the rest the decode workers')
        divided between the role's workers."""
        whole = self.gpu_memory_utilization
        if self.has_gpu_per_role:
            prefill_part = decode_part = whole
        else:
            prefill_part = whole * self.prefill_memory_fraction if self.num_prefill else 0.0
            decode_part = whole - prefill_part
        return prefill_part / max(self.num_prefill, 1), decode_part / self.num_decode_workers


def up_command(args: argparse.Namespace) -> int:
    settings = from_args(UpSettings, args)
    check_model(settings.model, settings.revision, settings.tokenizer, quantization=settings.quantization)
    configure_logging(settings.log_level, settings.log_format)
    return up(settings)


@dataclass(frozen=True)
class RoleArgs:
    """What `baton up` gives the processes it starts, besides their addresses."""

    worker: list[str]  # every worker's flags
    prefill: list[str]  # the prefill workers' own (over `worker`)
    decode: list[str]  # the decode workers' own
    gateway: list[str]
    env: dict[str, str]  # every process's extra environment


def role_args(settings: UpSettings) -> RoleArgs:
    logs = ["--log-level", settings.log_level, "--log-format", settings.log_format]  # every role's
    worker = [*logs, "--device", settings.device, "--dtype", settings.dtype,
              "--gpu-memory-utilization", str(settings.gpu_memory_utilization), "--kv-transport", settings.kv_transport]
    prefill_device, decode_device = settings.worker_devices()
    prefill, decode = ["--device", prefill_device], ["--device", decode_device]
    if settings.shares_a_gpu:
        # Each worker's --gpu-memory-utilization is its own share of the GPU (engine/runner/memory.py).
        # The workers start one after another (start_deployment's stagger), so each finds its
        # share free.
        prefill_share, decode_share = settings.gpu_memory_shares()
        if settings.num_prefill:
            prefill += ["--gpu-memory-utilization", f"{prefill_share:.4f}"]
        decode += ["--gpu-memory-utilization", f"{decode_share:.4f}"]
    if settings.speculative is not None:  # the decode workers speculate; prefill workers only prefill
        decode += ["--speculative", settings.speculative,
                   "--num-speculative-tokens", str(settings.num_speculative_tokens)]
        if settings.draft_model is not None:
            decode += ["--draft-model", settings.draft_model]
    if settings.kv_cache_memory is not None:
        worker += ["--kv-cache-memory", format_size(settings.kv_cache_memory)]
    if settings.max_model_len is not None:
        worker += ["--max-model-len", str(settings.max_model_len)]
    if settings.verify_kv:
        worker.append("--verify-kv")
    if not settings.prefix_caching:
        worker.append("--no-prefix-caching")
    if settings.kv_offload_memory:
        worker += ["--kv-offload-memory", format_size(settings.kv_offload_memory)]
    tls = []  # every role's
    for name in ("tls_cert", "tls_key", "tls_ca", "tls_server_name"):
        if getattr(settings, name) is not None:
            tls += ["--" + name.replace("_", "-"), getattr(settings, name)]
    model = []  # every role's
    for name in ("revision", "tokenizer", "served_model_name"):
        if getattr(settings, name) is not None:
            model += ["--" + name.replace("_", "-"), getattr(settings, name)]
    worker += model
    if settings.quantization is not None:  # the workers' alone: the gateway reads no weight
        worker += ["--quantization", settings.quantization]
    gateway = [*logs, *tls, *model]
    if settings.metrics_port is not None:  # 0: a free port chosen here, so the banner can name it
        gateway += ["--metrics-port", str(settings.metrics_port or free_port())]
    if settings.api_key_file is not None:
        gateway += ["--api-key-file", settings.api_key_file]
    # A key given as such goes in the environment, not on a command line anyone can read
    # (the workers have no such setting and ignore it).
    env = {} if settings.api_key is None else {"BATON_API_KEY": settings.api_key}
    return RoleArgs([*worker, *tls], prefill, decode, gateway, env)


def serves_http() -> bool:
    """Whether this host has the OpenAI API's stack (not the lent GPU machines: gRPC only there)."""
    return all(importlib.util.find_spec(name) is not None for name in ("fastapi", "uvicorn"))


def start_up(settings: UpSettings, log_dir: Path | None = None, *, metrics: bool = False) -> Deployment:
    """Start what `baton up` runs and wait until it serves: each process logs to `log_dir`
    (None: to our stdout); `metrics`: each serves Prometheus metrics on a port of its own
    (the end-to-end tests read them)."""
    # Every worker may use every core: idle workers sleep (see start_deployment).
    threads = settings.threads or max(1, len(os.sched_getaffinity(0)))
    args = role_args(settings)
    return start_deployment(
        settings.model,
        log_dir,
        gateway_address=f"127.0.0.1:{settings.port}",
        prefill=not settings.colocated,
        num_prefill=settings.num_prefill_workers,
        num_decode=settings.num_decode_workers,
        worker_args=args.worker,
        prefill_args=args.prefill,
        decode_args=args.decode,
        gateway_args=args.gateway,
        # --metrics-port: the gateway's is in its args; each worker gets a free port of its own.
        metrics=metrics or settings.metrics_port is not None,
        stagger=settings.shares_a_gpu,
        threads=threads,
        split_cores=settings.split_cores,
        timeout_s=STARTUP_TIMEOUT_S,
        env=args.env,
        admin_address="auto" if settings.admin_port is None else f"127.0.0.1:{settings.admin_port}",
        tls=settings.tls,
        api_key=settings.bearer_key,
        http_port=settings.http_port if settings.http_port and serves_http() else None,
    )


def metrics_banner(deployment: Deployment) -> str:
    """Where each process serves Prometheus metrics (`baton up --metrics-port`), the gateway first."""
    processes = sorted(deployment.processes, key=lambda process: process.role != "gateway")
    endpoints = [f"{process.role} http://127.0.0.1:{process.metrics_port}/metrics"
                 for process in processes if process.metrics_port is not None]
    return f"  metrics: {', '.join(endpoints)}\n" if endpoints else ""


def up(settings: UpSettings) -> int:
    stopping = False

    def stop(signum=None, frame=None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        deployment = start_up(settings)
    except (RuntimeError, TimeoutError) as error:
        print(f"baton up: {error}", file=sys.stderr)
        return 1
    gateway = deployment.gateway
    transport = IPC if settings.kv_transport == "auto" else settings.kv_transport  # one host
    mode = "colocated" if settings.colocated else f"disaggregated, KV over {transport}"
    if settings.num_prefill > 1 or settings.num_decode_workers > 1:
        prefill_workers = f"{settings.num_prefill} prefill + " if settings.num_prefill else ""
        mode += f", {prefill_workers}{settings.num_decode_workers} decode workers"
    if settings.speculative is not None:
        mode += f", speculative decoding: {settings.speculative} (up to {settings.num_speculative_tokens} tokens)"
    client_flags = "".join([
        f" --tls-ca {settings.tls_ca}" if settings.tls_ca else "",
        " --api-key <key>" if settings.bearer_key else "",
    ])
    status = ""
    if deployment.admin != gateway:  # --admin-port: a client certificate there with a CA, else the key
        admin_flags = (f" --tls-ca {settings.tls_ca} --tls-cert {settings.tls_cert} --tls-key {settings.tls_key}"
                       if settings.tls_ca else client_flags)
        status = f"  baton status --gateway {deployment.admin}{admin_flags}\n"
    http = ""
    if deployment.http:
        scheme = "https" if settings.tls else "http"
        key = " -H 'Authorization: Bearer <key>'" if settings.bearer_key else ""
        ca = f" --cacert {settings.tls_ca}" if settings.tls_ca else ""
        http = (f"  curl {scheme}://{deployment.http}/v1/chat/completions{ca}{key} -H 'Content-Type: application/json' "
                f"-d '{{\"model\": \"{settings.served_model_name or settings.model}\", \"messages\": "
                f"[{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}]}}'\n"
                f"  (OpenAI clients: base_url {scheme}://{deployment.http}/v1)\n")
    print(
        f"\nBaton is serving {settings.model} ({mode}) at {gateway}\n"
        f"  baton generate --gateway {gateway}{client_flags} --chat \"What is the capital of France?\"\n"
        f"{http}{status}{metrics_banner(deployment)}Ctrl-C stops it.\n",
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
