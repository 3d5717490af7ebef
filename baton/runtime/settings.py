"""Every setting of a Baton process, in one place: its default (written once), its
command-line flag, its environment variable, and how a bad value is reported.

A settings class is a frozen dataclass whose fields are declared with `setting()`.
Each such field is a flag (`--max-num-seqs` for `max_num_seqs`) and an environment
variable (`BATON_MAX_NUM_SEQS`); a flag given on the command line wins over the
variable, which wins over the default. `--help` shows each default and variable.
A setting that takes a fixed set of values (--device, --dtype, --log-level, ...) says
so (`choices=`), and a size what a bare number means (`size=`: --swap-space 4 is 4
GiB, as in vLLM); both are checked alike for flag and variable
(baton/runtime/settings_base.py holds that machinery, baton/runtime/values.py the
parsers). A value that does not parse or that the settings reject raises SettingsError
with a one-line message (the command prints it and exits 2, no traceback).

Defaults of the engine's knobs (block size, budgets, KV memory, ...) are the engine
config dataclasses' own (engine/config.py); the workers' flags read them from there.

This is the only module that reads environment variables for Baton's processes: the
BATON_* settings here, and the OpenTelemetry switches (`tracing_env`). The engine's
own few live in engine/envs.py.
"""

from __future__ import annotations

import argparse
import math
import os
import typing
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from baton.runtime.addresses import parse_target
from baton.runtime.discovery import AddressAllowlist
from baton.runtime.logs import LOG_FORMATS
from baton.runtime.security import TlsConfig, read_secret_file
from baton.runtime.settings_base import (
    SettingsError,
    argparse_type,
    base_type,
    default_of,
    env_name,
    flag_fields,
    flag_help,
    flag_name,
    metavar,
    parser_of,
    setting,
)
from baton.runtime.values import (
    format_cpu_list,
    format_size,
    parse_cpu_list,
    parse_port_range,
)
from engine.config import (
    ATTENTION_BACKENDS,
    DEFAULT_MODEL,
    DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    PreemptionMode,
    SchedulerConfig,
    SpeculativeConfig,
    engine_config,
)
from kvtransfer.endpoint import TRANSPORT_CHOICES, receiver_shares_cache

DEFAULT_GATEWAY_ADDRESS = "127.0.0.1:50051"
DEFAULT_HTTP_PORT = 8000  # `baton up`'s OpenAI HTTP API, where vLLM serves its
GRACE_S = 10.0  # SIGTERM: seconds in-flight calls get to finish (every role)
# A prefill worker's steps are prefill chunks only: a smaller token budget than a decode
# worker's keeps each step short, so a prompt's first token is not held up behind others.
PREFILL_MAX_NUM_BATCHED_TOKENS = 512
MODEL_HELP = (f"model: {DEFAULT_MODEL!r}, a Hugging Face model directory, a .gguf file, a hub id (org/name, "
              "from the local Hugging Face cache), or dummy:<name> (random weights at a real model's shapes: "
              "dummy:llama-3.1-8b, ...)")
REVISION_HELP = "of a hub id --model: a branch, tag or commit in the local Hugging Face cache (not --tokenizer's)"
TOKENIZER_HELP = "the tokenizer's own directory or hub id, when it is not --model's"
QUANTIZATION_HELP = ("fp8: quantize a 16-bit checkpoint's linear weights at load (per channel, activations per "
                     "token); an FP8 checkpoint is served as FP8 without it")
# The fixed sets some settings take (`setting(choices=...)`), as the engine, kvtransfer
# and logging accept them; `baton up` takes the same.
DEVICE_CHOICES = ("cpu", "cuda", "cuda:N")
PREEMPTION_MODES = typing.get_args(PreemptionMode)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMAT_HELP = ("log lines as text, or as JSON objects (time, level, logger, message; request_id, trace_id "
                   "and span_id on the lines of a request)")
DEVICE_HELP = "where the engine runs: the CPU, or a CUDA GPU (cuda: the current one)"
DTYPE_HELP = "weights' and KV cache's dtype (auto: float32 on CPU, bfloat16 on CUDA)"
TLS_CERT_HELP = "PEM certificate chain this process serves and presents as a client (a TLS secret's tls.crt)"
TLS_KEY_HELP = "PEM private key of --tls-cert (tls.key)"
TLS_CA_HELP = ("PEM CA bundle (ca.crt): internal ports then require client certificates it signed, and "
               "calls to other Baton processes verify them against it")
TLS_SERVER_NAME_HELP = "name to expect in peers' server certificates, when they are dialled by an address it lacks"
API_KEY_HELP = "clients must send 'authorization: Bearer <key>' (HTTP: checked before anything else is read)"
API_KEY_FILE_HELP = "read the API key from this file (a mounted secret)"
ADMIN_ON_PUBLIC_PORT = "public"  # --admin-listen's value that serves GatewayAdmin on --listen
HEALTH_PORT_HELP = ("also serve grpc.health.v1 alone, in plaintext, on this port of the listen address "
                    "(Kubernetes' gRPC probes speak no TLS)")
# --speculative: "none" is off (None), as the engine's SpeculativeConfig.method.
SPECULATIVE_CHOICES = ("none", *SPECULATIVE_METHODS)
SPECULATIVE_HELP = ("speculative decoding, on decode workers: ngram proposes a row's next tokens from its prompt "
                    "and output so far (prompt lookup), draft has --draft-model draft them; one forward pass "
                    "checks them, and the tokens are those decoding without it gives")
DRAFT_MODEL_HELP = ("with --speculative draft: a small model with the served model's tokenizer (as --model names "
                    "one), run beside it with a KV cache of its own")
KV_OFFLOAD_MEMORY_HELP = ("host memory for the prefix cache's second tier: full blocks are written through to it "
                          "and copied back when the device cache has evicted them (shared with the swap pool)")
NUM_SPECULATIVE_TOKENS_HELP = "most tokens a row proposes a step, with --speculative (fewer when they do not pay)"
GPU_MEMORY_UTILIZATION_HELP = ("CUDA: fraction of the GPU's memory for weights, activations and the KV cache, "
                               "which gets what the rest leaves")


def kv_transport_setting():
    """--kv-transport, declared once for the decode and prefill workers and `baton up`."""
    return setting("auto", "how KV moves from a prefill worker to a decode worker: auto (ipc on one host, "
                           "else nccl between GPUs or gloo between CPU hosts), ipc, nccl or gloo",
                   choices=TRANSPORT_CHOICES)


# ------------------------------------------------------------------ flags and env
def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag per setting of `cls`; its default is left to `from_args`, which knows the
    environment (so --help shows the built-in default and the variable's name)."""
    for f, hint in flag_fields(cls):
        if base_type(hint) is bool:
            parser.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=flag_help(f))
        else:
            parser.add_argument(flag_name(f.name), type=argparse_type(parser_of(f, hint)), default=argparse.SUPPRESS,
                                metavar=metavar(f, hint), help=flag_help(f))


def from_args(cls: type, args: argparse.Namespace, env: Mapping[str, str] | None = None, **fixed: Any):
    """Settings of `cls` from parsed flags, then BATON_* variables, then defaults; `fixed`
    values are not settings (e.g. a role). SettingsError (one line) on a bad value."""
    env = os.environ if env is None else env
    values = dict(fixed)
    for f, hint in flag_fields(cls):
        if f.name in args:
            values[f.name] = getattr(args, f.name)
        elif env_name(f.name) in env:
            text = env[env_name(f.name)]
            try:
                values[f.name] = parser_of(f, hint)(text)
            except ValueError as error:
                raise SettingsError(f"{env_name(f.name)}={text!r}: {error}") from None
    try:
        return cls(**values)
    except (ValueError, TypeError) as error:
        raise SettingsError(str(error)) from None


def load_tls(settings) -> TlsConfig | None:
    """The TLS files a settings object names, read now (ValueError if one is unreadable)."""
    return TlsConfig.load(settings.tls_cert, settings.tls_key, settings.tls_ca, settings.tls_server_name)


def load_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The API key, given or read from its file (ValueError for both, or an unreadable file)."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        return read_secret_file(api_key_file, "--api-key-file").decode().strip()
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty")
    return api_key


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus `extra`, for a child process."""
    return {**os.environ, **(extra or {})}


# ------------------------------------------------------------------ the roles
def _half_the_cores() -> int:
    """Half the cores this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


KV_CACHE_MEMORY_SHOWN = (f"{format_size(CacheConfig.DEFAULT_KV_CACHE_MEMORY_BYTES)} on CPU, "
                         "from --gpu-memory-utilization on CUDA")


@dataclass(frozen=True)
class WorkerSettings:
    """One worker process: where it listens, what it serves, how its engine is sized."""

    role: ClassVar[str] = ""  # "prefill" | "decode", set by the role's subclass

    listen: str = setting("127.0.0.1:0", "address to listen on (port 0: any free port)")
    advertise: str | None = setting(None, "address peers reach this worker at", shown="the listen address")
    worker_id: str = setting(help="worker id in stats, logs and KV handles", shown="random",
                             default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    model: str = setting(DEFAULT_MODEL, MODEL_HELP)
    revision: str | None = setting(None, REVISION_HELP, shown="main")
    tokenizer: str | None = setting(None, TOKENIZER_HELP, shown="--model's")
    served_model_name: str | None = setting(None, "the model's name in GetModelInfo, stats and the HTTP API",
                                            shown="--model")
    device: str = setting(default_of(EngineConfig, "device"), DEVICE_HELP, choices=DEVICE_CHOICES)
    dtype: str = setting(default_of(EngineConfig, "dtype"), DTYPE_HELP, choices=DTYPE_CHOICES)
    quantization: str | None = setting(None, QUANTIZATION_HELP, choices=QUANTIZATION_CHOICES, shown="the checkpoint's")
    max_model_len: int | None = setting(None, "cap on prompt + output tokens", shown="the model's")
    block_size: int = setting(default_of(CacheConfig, "block_size"), "tokens per KV block")
    num_kv_blocks: int | None = setting(None, "KV blocks", shown="from --kv-cache-memory")
    kv_cache_memory: int | None = setting(None, "KV cache budget", size="B", shown=KV_CACHE_MEMORY_SHOWN)
    gpu_memory_utilization: float = setting(default_of(CacheConfig, "gpu_memory_utilization"),
                                            GPU_MEMORY_UTILIZATION_HELP)
    swap_space: int = setting(default_of(CacheConfig, "swap_space_bytes"), "CPU swap pool for swap preemption",
                              size="GiB", shown=format_size(default_of(CacheConfig, "swap_space_bytes")))
    prefix_caching: bool = setting(default_of(CacheConfig, "enable_prefix_caching"),
                                   "keep the KV of full blocks by content and share it between prompts that "
                                   "start alike (--no-prefix-caching: off)")
    kv_offload_memory: int = setting(default_of(CacheConfig, "kv_offload_bytes"), KV_OFFLOAD_MEMORY_HELP,
                                     size="GiB", shown="0: off")
    max_num_seqs: int = setting(default_of(SchedulerConfig, "max_num_seqs"), "sequences per step")
    max_num_batched_tokens: int = setting(default_of(SchedulerConfig, "max_num_batched_tokens"),
                                          "token budget per step (prefill chunks + decodes)")
    max_decode_stretch: float = setting(default_of(SchedulerConfig, "max_decode_stretch"),
                                        "decode: once handed-off requests arrive, a step with decoding requests "
                                        "takes at most this many decode steps' time of prompts (0: no limit)")
    preemption_mode: str = setting(default_of(SchedulerConfig, "preemption_mode"),
                                   "auto: the cheaper of recompute and swap, per sequence",
                                   choices=PREEMPTION_MODES)
    attention_backend: str = setting(default_of(EngineConfig, "attention_backend"),
                                     "auto: triton on CUDA, cpu on CPU",
                                     choices=ATTENTION_BACKENDS)
    enforce_eager: bool = setting(default_of(EngineConfig, "enforce_eager"),
                                  "CUDA: run every step eagerly, without CUDA graphs of decode steps")
    overlap_scheduling: bool | None = setting(None, "schedule each step while the device runs the one before",
                                              shown="on CUDA, off on CPU")
    cpus: tuple[int, ...] = setting((), "cores this worker's threads run on, a Linux CPU list such as 0-3,8 "
                                        "(give each worker on a host its own)", parse=parse_cpu_list,
                                    shown="every core")
    threads: int | None = setting(None, "torch threads", shown="one per --cpus core, else half the cores")
    lease_s: float = setting(30.0, "prefill: seconds held KV waits to be pulled")
    transfer_timeout_s: float = setting(30.0, "timeout of each KV rendezvous and transfer")
    verify_kv: bool = setting(False, "checksum every transferred KV block on both sides")
    transfer_host: str | None = setting(None, "decode: the address prefill workers reach this worker's KV "
                                              "rendezvous and Gloo socket at (gloo, nccl)",
                                        shown="the advertised address's host")
    kv_ports: tuple[int, int] | None = setting(None, "KV data plane ports, LOW-HIGH: the rendezvous store listens "
                                                     "on one of them; give the process's ephemeral port range "
                                                     "(net.ipv4.ip_local_port_range) the same, since Gloo and "
                                                     "NCCL open theirs there", parse=parse_port_range,
                                               shown="any free port")
    kv_transport: str = kv_transport_setting()
    grace_s: float = setting(GRACE_S, "SIGTERM: seconds for in-flight requests")
    stall_report_s: float = setting(60.0, "liveness turns NOT_SERVING when the engine thread has been stuck "
                                          "in a step this long")
    metrics_port: int | None = setting(None, "serve Prometheus metrics on this port (0: any free one)",
                                       shown="off")
    health_port: int | None = setting(None, HEALTH_PORT_HELP, shown="off")
    # Admission control (baton/runtime/admission.py): beyond these, calls are refused
    # with RESOURCE_EXHAUSTED and a retry hint instead of queued.
    max_queued_requests: int = setting(0, "requests in flight beyond --max-num-seqs before Prefill/Decode "
                                          "calls are refused (0: --max-num-seqs)")
    max_queued_tokens: int = setting(0, "prompt tokens waiting to be prefilled or received, beyond which "
                                        "calls are refused (0: 4x the KV cache's capacity in tokens)")
    log_level: str = setting("INFO", "logging level", choices=LOG_LEVELS)
    log_format: str = setting("text", LOG_FORMAT_HELP, choices=LOG_FORMATS)
    tls_cert: str | None = setting(None, TLS_CERT_HELP, shown="plaintext")
    tls_key: str | None = setting(None, TLS_KEY_HELP)
    tls_ca: str | None = setting(None, TLS_CA_HELP, shown="no client certificates")
    tls_server_name: str | None = setting(None, TLS_SERVER_NAME_HELP, shown="the host dialled")
    # Built from the settings above (validated on construction).
    engine: EngineConfig = field(init=False, repr=False, compare=False)
    tls: TlsConfig | None = field(init=False, repr=False, compare=False)

    @property
    def num_threads(self) -> int:
        """--threads, else one per core of --cpus, else half the cores."""
        return self.threads or len(self.cpus) or _half_the_cores()

    def __post_init__(self) -> None:
        if not self.role:
            raise TypeError("use PrefillWorkerSettings or DecodeWorkerSettings")
        for name in ("lease_s", "transfer_timeout_s", "stall_report_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")
        unavailable = set(self.cpus) - os.sched_getaffinity(0) if self.cpus else set()
        if unavailable:
            raise ValueError(f"cpus {format_cpu_list(unavailable)} are not available to this process "
                             f"(it may use {format_cpu_list(os.sched_getaffinity(0))})")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.max_queued_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError("max_queued_requests and max_queued_tokens must be >= 0 (0: derived)")
        object.__setattr__(self, "tls", load_tls(self))
        object.__setattr__(self, "engine", engine_config(
            self.model,
            revision=self.revision, tokenizer=self.tokenizer, served_model_name=self.served_model_name,
            quantization=self.quantization,
            device=self.device, dtype=self.dtype, max_model_len=self.max_model_len, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            # An explicit block count sizes the pool by itself.
            kv_cache_memory_bytes=None if self.num_kv_blocks else self.kv_cache_memory,
            swap_space_bytes=self.swap_space,
            kv_offload_bytes=self.kv_offload_memory,
            enable_prefix_caching=self.prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_decode_stretch=self.max_decode_stretch,
            preemption_mode=self.preemption_mode,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            overlap_scheduling=self.overlap_scheduling,
            shareable=receiver_shares_cache(self.kv_transport) and self.role == "decode",
            **self.role_engine_options(),
        ))

    def role_engine_options(self) -> dict[str, Any]:
        """engine_config's keywords of the role's own settings."""
        return {}


@dataclass(frozen=True)
class PrefillWorkerSettings(WorkerSettings):
    role: ClassVar[str] = "prefill"
    max_num_batched_tokens: int = setting(PREFILL_MAX_NUM_BATCHED_TOKENS,
                                          "token budget per step (prefill chunks)")
    # Its steps are prompt chunks, which CUDA graphs of decode steps do not serve.
    enforce_eager: bool = setting(True, "CUDA: run every step eagerly (a prefill worker's steps are prompt "
                                        "chunks: graphs of decode steps would only hold memory)")


# A decode worker's token messages a second, by default: what one gateway process relays
# (in and out) beside the workers on a shared 2-core machine. 256 requests of 400 tokens
# sent at once to one-thread workers were all delivered in 34 s unbounded (the decode
# worker done at 21 s, the gateway at a core relaying the rest), 16 s at 1,000, 12 s at
# 2,000, 23 s at 4,000 (one run each).
DEFAULT_STREAM_MESSAGES_PER_S = 2000.0
# A gateway's, shared among its decode workers (each DecodeRequest carries the worker's
# share). Its one event loop also takes every new call, a few turns of the loop each: 1,500
# calls of 400 tokens through 256 callers to 1 prefill + 2 decode workers, one thread
# each, on 2 shared cores (benchmarks/cold_burst.py, one run each), were refused up to
# 12-18 s after the call with the workers at 2,000 each; at 500 each, 5 s; at 1,000 in
# all with DecodeProgress reading delivered spans, all 1,500 completed in time.
DEFAULT_GATEWAY_MESSAGES_PER_S = 1000.0


@dataclass(frozen=True)
class DecodeWorkerSettings(WorkerSettings):
    role: ClassVar[str] = "decode"
    # Security: the prefill workers a KV handle may name; this worker dials no other.
    allowed_prefill_workers: tuple[str, ...] = setting((), "comma-separated prefill worker addresses (host:port "
                                                           "as they advertise them, or dns:///name:port) whose KV "
                                                           "handles this worker pulls; a handle naming another is "
                                                           "refused, so a forged one cannot make it connect "
                                                           "anywhere else. Unset: it pulls from none and prefills "
                                                           "handed-off prompts itself; '*': from any address (a "
                                                           "network where every caller is trusted)",
                                                           shown="none: prefills here")
    # Speculative decoding: a decode worker's alone (a prefill worker's rows only prefill,
    # and a speculating engine schedules no step while the one before runs).
    speculative: str | None = setting(None, SPECULATIVE_HELP, choices=SPECULATIVE_CHOICES, shown="off")
    num_speculative_tokens: int = setting(default_of(SpeculativeConfig, "num_speculative_tokens"),
                                          NUM_SPECULATIVE_TOKENS_HELP)
    draft_model: str | None = setting(None, DRAFT_MODEL_HELP, shown="none")
    max_stream_messages_per_s: float = setting(
        DEFAULT_STREAM_MESSAGES_PER_S, "token messages a second this worker sends, all its streams together: past "
                                       "it (a large batch of fast steps), each stream's tokens gather for up to "
                                       "(its streams / this) seconds and go as one message, so that the gateway "
                                       "relaying them keeps up instead of falling behind the steps")
    # Built from the settings above (validated on construction).
    prefill_allowlist: AddressAllowlist = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.speculative == "none":
            object.__setattr__(self, "speculative", None)
        super().__post_init__()
        if not self.max_stream_messages_per_s > 0:
            raise ValueError(f"--max-stream-messages-per-s must be > 0, got {self.max_stream_messages_per_s}")
        try:
            allowlist = AddressAllowlist(self.allowed_prefill_workers)
        except ValueError as error:
            raise ValueError(f"--allowed-prefill-workers: {error}") from None
        object.__setattr__(self, "prefill_allowlist", allowlist)

    def role_engine_options(self) -> dict[str, Any]:
        return dict(speculative=self.speculative, num_speculative_tokens=self.num_speculative_tokens,
                    draft_model=self.draft_model)


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway process."""

    listen: str = setting(DEFAULT_GATEWAY_ADDRESS, "address to listen on")
    prefill_workers: tuple[str, ...] = setting((), "comma-separated prefill workers: host:port, or "
                                                   "dns:///name:port for every address the name resolves to")
    decode_workers: tuple[str, ...] = setting((), "comma-separated decode workers, as --prefill-workers "
                                                  "(at least one)")
    discovery_interval_s: float = setting(5.0, "seconds between lookups of dns:/// worker names (workers that "
                                               "join are used, workers that leave are drained)")
    model: str = setting(DEFAULT_MODEL, "model whose tokenizer to load (never its weights); the workers must "
                                        "serve it")
    revision: str | None = setting(None, REVISION_HELP, shown="main")
    tokenizer: str | None = setting(None, TOKENIZER_HELP, shown="--model's")
    startup_timeout_s: float = setting(600.0, "seconds to wait for a decode worker to serve before exiting "
                                              "with an error")
    grace_s: float = setting(GRACE_S, "SIGTERM: seconds for in-flight requests")
    metrics_port: int | None = setting(None, "serve Prometheus metrics on this port (0: any free one)",
                                       shown="off")
    health_port: int | None = setting(None, HEALTH_PORT_HELP, shown="off")
    http_port: int | None = setting(None, "serve the OpenAI HTTP API (/v1/completions, /v1/chat/completions, "
                                          "/v1/models) on this port, on --listen's host (0: any free one)",
                                    shown="off")
    served_model_name: str | None = setting(None, "the model id the HTTP API shows and requests must name",
                                            shown="the workers' model")
    # Conditional disaggregation (RoutingPolicy in gateway/workers.py).
    max_local_prefill_tokens: int = setting(0, "prompts this short are prefilled on their decode worker "
                                               "(no handoff)")
    max_prefill_queue_tokens: int = setting(2048, "above this many queued prefill tokens, prompts go to a "
                                                  "decode worker with fewer queued (0: never)")
    cross_host_tokens: int = setting(512, "a prefill worker on another host than the decode worker (its KV "
                                          "crosses the network, not shared memory) counts as this many more "
                                          "queued prompt tokens")
    # Lost workers (gateway/workers.py, gateway/dispatch.py).
    stall_timeout_s: float = setting(1.0, "a worker silent this long (or 50 of its recent steps, if longer) "
                                          "and then failing a probe is lost: its requests move")
    max_migrations: int = setting(3, "a request moves to another worker at most this many times")
    # Relaying (gateway/dispatch.py): what one gateway process relays, in and out.
    max_stream_messages_per_s: float = setting(
        DEFAULT_GATEWAY_MESSAGES_PER_S, "token messages a second this gateway relays, all its streams together, "
                                        "shared among its decode workers (each gets its share with every stream "
                                        "and sends no more): past it, each stream's tokens gather into fewer, "
                                        "larger messages, so that the gateway's loop keeps up with its load and "
                                        "answers new calls at once")
    # Admission control (gateway/admission.py): beyond these, or when a request's gRPC
    # deadline cannot be met, requests are refused at once with RESOURCE_EXHAUSTED and a
    # retry hint.
    max_concurrent_requests: int = setting(0, "sequences in flight (a request of n choices counts n) before new "
                                              "requests are refused (0: the decode workers' --max-num-seqs, "
                                              "summed)")
    max_queue_wait_s: float = setting(60.0, "requests whose first token is forecast further off than this "
                                            "(the prompt tokens queued ahead, at the prefill workers' measured "
                                            "rate) are refused")
    max_queued_tokens: int = setting(0, "prompt tokens admitted and not yet prefilled, beyond which new "
                                        "requests are refused (0: no such bound)")
    log_level: str = setting("INFO", "logging level", choices=LOG_LEVELS)
    log_format: str = setting("text", LOG_FORMAT_HELP, choices=LOG_FORMATS)
    # Security (baton/runtime/security.py).
    admin_listen: str | None = setting(None, "serve GatewayAdmin (baton status: every worker's address and "
                                             "load) here, with the workers' TLS (client certificates with "
                                             f"--tls-ca), apart from the public port; '{ADMIN_ON_PUBLIC_PORT}': "
                                             "on --listen, behind --api-key",
                                       shown="off, so that no caller of the public port learns the workers")
    api_key: str | None = setting(None, API_KEY_HELP, shown="none, open", secret=True)
    api_key_file: str | None = setting(None, API_KEY_FILE_HELP)
    tls_cert: str | None = setting(None, TLS_CERT_HELP + "; --listen serves TLS without client certificates",
                                   shown="plaintext")
    tls_key: str | None = setting(None, TLS_KEY_HELP)
    tls_ca: str | None = setting(None, TLS_CA_HELP, shown="no client certificates")
    tls_server_name: str | None = setting(None, TLS_SERVER_NAME_HELP, shown="the host dialled")
    # Built from the settings above (files read on construction).
    tls: TlsConfig | None = field(init=False, repr=False, compare=False)
    bearer_key: str | None = field(init=False, repr=False, compare=False)  # --api-key or the file's

    def __post_init__(self) -> None:
        if not self.decode_workers:
            raise ValueError("the gateway needs at least one decode worker (--decode-workers)")
        for flag, targets in (("--prefill-workers", self.prefill_workers), ("--decode-workers", self.decode_workers)):
            for target in targets:
                try:
                    parse_target(target)
                except ValueError as error:
                    raise ValueError(f"{flag}: {error}") from None
        for name in ("discovery_interval_s", "startup_timeout_s", "max_queue_wait_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_local_prefill_tokens < 0 or self.max_prefill_queue_tokens < 0 or self.cross_host_tokens < 0:
            raise ValueError("routing thresholds must be >= 0")
        if self.max_concurrent_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError("max_concurrent_requests and max_queued_tokens must be >= 0 (0: derived)")
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        if not 0 < self.max_stream_messages_per_s < math.inf:
            raise ValueError(f"--max-stream-messages-per-s must be > 0 and finite, got {self.max_stream_messages_per_s}")
        if self.admin_listen is not None and self.admin_listen == self.listen:
            raise ValueError(f"--admin-listen must differ from --listen (to serve it there: --admin-listen "
                             f"{ADMIN_ON_PUBLIC_PORT})")
        object.__setattr__(self, "tls", load_tls(self))
        object.__setattr__(self, "bearer_key", load_api_key(self.api_key, self.api_key_file))


# ------------------------------------------------------------------ tracing
@dataclass(frozen=True, slots=True)
class TracingEnv:
    """The OpenTelemetry variables that decide whether and how this process exports spans
    (the SDK and the exporter read the rest themselves: sampler, batching, headers, TLS)."""

    endpoint: str | None  # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT
    disabled: bool  # OTEL_SDK_DISABLED=true
    protocol: str  # "grpc" or "http/protobuf"
    names_service: bool  # OTEL_SERVICE_NAME or service.name in OTEL_RESOURCE_ATTRIBUTES is set


def tracing_env() -> TracingEnv:
    env = os.environ
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    return TracingEnv(
        endpoint=env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        disabled=env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true",
        protocol=protocol.strip().lower(),
        names_service=bool(env.get("OTEL_SERVICE_NAME"))
        or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", ""),
    )
