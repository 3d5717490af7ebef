"""Typed, validated engine configuration: one frozen dataclass per concern."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DEVICE = "cpu"
# The dtype "auto" stands for, per device type: CPU matmuls are fastest and exact in
# float32; GPUs run bfloat16 at full tensor-core rate.
DEFAULT_DTYPES = {"cpu": "float32", "cuda": "bfloat16"}

SchedulerPolicy = Literal["continuous", "static"]
PreemptionMode = Literal["auto", "recompute", "swap"]


class PreemptionKind(enum.Enum):
    """How one request was preempted (the mode "auto" picks one per request)."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


# Attention backend names (engine.attention.get_attention_backend builds them). "auto":
# "triton" on CUDA; on CPU the native backend when its kernels build, else "torch".
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")

# User-facing dtype names, and the torch dtype each stands for.
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16",
           "float64": "float64", "fp64": "float64"}
_DTYPE_NAMES = "auto, float32, bfloat16, float16 or float64"
# Every name a dtype setting takes (the short ones as vLLM's --dtype takes them: half, ...).
DTYPE_CHOICES = ("auto", *_DTYPES)
# What a model (and its KV cache) can hold, as torch names the dtypes.
DTYPES = frozenset(_DTYPES.values())


def resolve_dtype(dtype: str | torch.dtype, device: str = DEFAULT_DEVICE) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype; "auto" is the device's default."""
    import torch  # here, not at import: the settings of every process import this module

    if isinstance(dtype, torch.dtype):
        if str(dtype).removeprefix("torch.") not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use {_DTYPE_NAMES}")
        return dtype
    if dtype.lower() == "auto":
        dtype = DEFAULT_DTYPES[device_type(device)]
    try:
        return getattr(torch, _DTYPES[dtype.lower()])
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use {_DTYPE_NAMES}") from None


def device_type(device: str) -> str:
    """"cpu" or "cuda" for a device string ("cpu", "cuda", "cuda:N"); ValueError otherwise."""
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return kind
    if kind == "cuda" and (not index or index.isdigit()):
        return kind
    raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape and size.

    At most one of `num_kv_blocks` / `kv_cache_memory_bytes` sizes the device
    pool. When neither is given, a CPU engine takes the default budget
    (DEFAULT_KV_CACHE_MEMORY_BYTES) and a CUDA engine what is left of
    `gpu_memory_utilization` of the GPU's memory after the weights and a
    profiling forward at the full token budget (as vLLM sizes it). The swap
    pool (host memory, pinned on CUDA, for swap preemption) is sized by
    `num_swap_blocks` or, if that is None, by `swap_space_bytes`. The prefix cache's
    host tier (engine/kv/host_tier.py: full blocks kept in host memory once the device
    cache evicts them) adds `num_offload_blocks` or, if None, `kv_offload_bytes` of host
    memory to that pool, which the two share; 0: no host tier.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_swap_blocks: int | None = None
    swap_space_bytes: int = 256 * 1024**2
    num_offload_blocks: int | None = None
    kv_offload_bytes: int = 0
    gpu_memory_utilization: float = 0.9
    # Another process on this host may map the device blocks and write KV into them
    # (kvtransfer's ipc transport; see KVCache). A decode worker's cache is shareable.
    shareable: bool = False
    # Keep the KV of full blocks by content and share it between requests whose
    # prompts start alike (engine/kv/prefix_hash.py, KVCacheManager).
    enable_prefix_caching: bool = True

    DEFAULT_KV_CACHE_MEMORY_BYTES = 1024**3

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory_bytes, not both")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.num_swap_blocks is not None and self.num_swap_blocks < 0:
            raise ValueError("num_swap_blocks must be >= 0")
        if self.swap_space_bytes < 0:
            raise ValueError("swap_space_bytes must be >= 0")
        if (self.num_offload_blocks or 0) < 0 or self.kv_offload_bytes < 0:
            raise ValueError("num_offload_blocks and kv_offload_bytes must be >= 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def is_sized(self) -> bool:
        """Whether the pool's size is given (else a CUDA engine measures what is free)."""
        return self.num_kv_blocks is not None or self.kv_cache_memory_bytes is not None

    def resolve_num_blocks(self, bytes_per_block: int, free_bytes: int | None = None) -> int:
        """Number of device blocks: the explicit count, else the memory budget, else
        `free_bytes` (what profiling left for the cache), else the default budget."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.kv_cache_memory_bytes or free_bytes or self.DEFAULT_KV_CACHE_MEMORY_BYTES
        num_blocks = budget // bytes_per_block
        if num_blocks <= 0:
            raise ValueError(
                f"kv cache budget of {budget} bytes holds no block of {bytes_per_block} bytes"
            )
        return num_blocks

    def resolve_num_offload_blocks(self, bytes_per_block: int) -> int:
        """The host tier's blocks (0 without prefix caching, which it extends)."""
        if not self.enable_prefix_caching:
            return 0
        if self.num_offload_blocks is not None:
            return self.num_offload_blocks
        return self.kv_offload_bytes // bytes_per_block

    def resolve_num_swap_blocks(self, bytes_per_block: int) -> int:
        if self.num_swap_blocks is not None:
            return self.num_swap_blocks
        return self.swap_space_bytes // bytes_per_block


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget, iteration-level scheduling limits and policies.

    - `max_num_batched_tokens`: tokens (decode tokens + prefill chunk tokens)
      run in one forward pass.
    - `max_num_seqs`: sequences in one forward pass.
    - `policy`: "continuous" (iteration-level) or "static" (fill a batch of up
      to max_num_seqs, run it to completion, then admit the next batch).
    - `preemption_mode`: "auto" picks recompute or swap per sequence by
      estimated cost; "recompute" / "swap" force one kind (swap falls back to
      recompute when the swap pool is full).
    - `priority_aging_steps`: a waiting request's effective priority improves
      by one for every this many steps it waits, so low priority cannot starve.
    - `admission_reserve_steps`: admitting a request requires free blocks for
      its next chunk plus this many decode steps of growth, so a newcomer is not
      preempted right away.
    - `long_prefill_token_threshold`: cap on one request's chunk per step
      (0 = only the step budget limits it), so one long prompt cannot take a
      whole step from the others.
    - `max_decode_stretch`: once the engine has received a handed-off request, a step
      with decoding rows takes at most this many decode steps' time of prompt tokens
      (engine/scheduler/budget.py); 0 = only the step budget limits them.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: SchedulerPolicy = "continuous"
    preemption_mode: PreemptionMode = "auto"
    priority_aging_steps: int = 64
    admission_reserve_steps: int = 4
    long_prefill_token_threshold: int = 0
    max_decode_stretch: float = 2.0

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"scheduler_policy must be 'continuous' or 'static', got {self.policy!r}")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'auto', 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.priority_aging_steps <= 0:
            raise ValueError("priority_aging_steps must be positive")
        if self.admission_reserve_steps < 0:
            raise ValueError("admission_reserve_steps must be >= 0")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not 0 <= self.max_decode_stretch < float("inf"):
            raise ValueError("max_decode_stretch must be a finite number >= 0")


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode): a decoding row proposes up to
    `num_speculative_tokens` tokens and one forward pass of the model checks them all.

    - `method`: "ngram" (prompt lookup: the tokens after the latest earlier occurrence of
      the row's last `prompt_lookup_max`..`prompt_lookup_min` tokens), "draft" (the
      `draft_model`, a small model with the target's tokenizer, drafts them greedily from a
      KV cache of `draft_num_kv_blocks` blocks, None: as many as the target's); None: off.
    - `adaptive`: each row proposes as many tokens (up to num_speculative_tokens) as its
      acceptance rate so far and the step-time model make worth their cost (none when
      speculation would be slower: the off-switch); False: always as many as it can.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    adaptive: bool = True
    draft_model: str | None = None
    draft_num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)} "
                             f"(or none), got {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model is given with speculative method 'draft', and only then")
        if self.draft_num_kv_blocks is not None and self.draft_num_kv_blocks <= 0:
            raise ValueError("draft_num_kv_blocks must be positive")
        if self.num_speculative_tokens <= 0:
            raise ValueError(f"num_speculative_tokens must be positive, got {self.num_speculative_tokens}")
        if not 0 < self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 0 < min <= max")


# What `quantization` takes (engine/model/quantization.py).
QUANTIZATION_CHOICES = ("fp8",)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from."""

    model: str = DEFAULT_MODEL
    revision: str | None = None  # of a hub id: a branch, tag or commit (None: main)
    tokenizer: str | None = None  # where the tokenizer is, when not with the model
    served_model_name: str | None = None  # the name clients see (None: `model`)
    # "fp8": a 16-bit checkpoint's linear weights quantized at load (an FP8 checkpoint is by itself).
    quantization: str | None = None
    device: str = DEFAULT_DEVICE  # "cpu", "cuda" or "cuda:N"
    dtype: str | torch.dtype = "auto"  # a torch.dtype once constructed ("auto": DEFAULT_DTYPES)
    max_model_len: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    attention_backend: str = "auto"
    seed: int = 0
    # CUDA: decode steps replay CUDA graphs (engine/runner/decode_graphs.py) unless this is set.
    enforce_eager: bool = False
    # Schedule step N+1 while the device runs step N (see LLMEngine.step); None: on CUDA only.
    overlap_scheduling: bool | None = None
    # Measure the step-time model when a worker starts (engine/runner/step_time.py), so that it
    # is published before the first request.
    calibrate_step_time: bool = True

    def __post_init__(self) -> None:
        device_type(self.device)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"unknown quantization {self.quantization!r}; available: "
                             + ", ".join(QUANTIZATION_CHOICES))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"available: {', '.join(ATTENTION_BACKENDS)}"
            )


# Flat keyword names that differ from their field's: LLM(scheduler_policy=...) is SchedulerConfig.policy.
_KEYWORD_ALIASES = {"scheduler_policy": "policy", "speculative": "method"}


def engine_config(model: str = DEFAULT_MODEL, **kwargs: Any) -> EngineConfig:
    """An EngineConfig from flat keywords, each routed to the config that has a field of its name.

    The names are the fields of EngineConfig (revision, tokenizer, served_model_name,
    device, dtype, max_model_len, attention_backend, seed), CacheConfig (block_size, num_kv_blocks, ...) and
    SchedulerConfig (max_num_seqs, max_num_batched_tokens, ...; its `policy`
    also as `scheduler_policy`) and SpeculativeConfig (num_speculative_tokens,
    prompt_lookup_max, prompt_lookup_min; its `method` as `speculative`). What is not given keeps the dataclass's default.
    Raises TypeError for any other name.
    """
    sections: dict[type, dict[str, Any]] = {EngineConfig: {}, CacheConfig: {}, SchedulerConfig: {},
                                            SpeculativeConfig: {}}
    owners = {
        f.name: cls
        for cls in sections
        for f in fields(cls)
        if f.name not in ("model", "cache", "scheduler", "speculative")  # given otherwise
    }
    for keyword, value in kwargs.items():
        name = _KEYWORD_ALIASES.get(keyword, keyword)
        owner = owners.get(name)
        if owner is None:
            raise TypeError(f"engine_config() got an unexpected keyword argument {keyword!r}")
        if name in sections[owner]:
            raise TypeError(f"engine_config() got {name!r} twice (as {keyword!r})")
        sections[owner][name] = value
    return EngineConfig(
        model=model,
        cache=CacheConfig(**sections[CacheConfig]),
        scheduler=SchedulerConfig(**sections[SchedulerConfig]),
        speculative=SpeculativeConfig(**sections[SpeculativeConfig]),
        **sections[EngineConfig],
    )
