"""Native CPU kernels, compiled on first use with torch's C++ extension builder.

`load_cpu_kernels()` builds `cpu_attention.cpp` (paged decode attention) and
`cpu_ops.cpp` (RMSNorm, RoPE, SiLU-and-mul, a MoE's grouped matmul) once per source version (the build
is cached under torch's extensions directory, TORCH_EXTENSIONS_DIR) and
registers the ops under `torch.ops.baton`. A build is slow (docs/engine.md says how
slow); `make setup` runs it so that tests and servers start warm.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
from pathlib import Path

import torch

from engine.envs import native_arch

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
# What the kernels are compiled for (AT_DISPATCH_FLOATING_TYPES_AND(kBFloat16, ...)).
CPU_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_NAME = "baton_cpu_kernels"
_SOURCES = (_DIR / "cpu_attention.cpp", _DIR / "cpu_ops.cpp")
_HEADERS = (_DIR / "cpu_math.h",)


def _headers_digest() -> str:
    """Digest of the headers: torch's build cache only hashes sources and flags,
    so it goes into the flags to rebuild when a header changes."""
    digest = hashlib.sha256()
    for path in _HEADERS:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def load_cpu_kernels() -> None:
    """Build (or load the cached build of) the CPU kernels; raises if the compiler fails."""
    from torch.utils import cpp_extension

    # No fused multiply-add contraction: elementwise ops then round exactly as
    # torch's eager kernels do (the attention kernel's FMAs are explicit).
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-mprefer-vector-width=512"]
    # Tune for the machine that builds, which is the machine that runs: the
    # build is cached per machine and BATON_NATIVE_ARCH overrides it.
    flags.append(f"-march={native_arch()}")
    flags.append(f"-DBATON_HEADERS_DIGEST={_headers_digest()}")
    logger.info("loading Baton's CPU kernels (the first build takes about half a minute)")
    with _build_lock(Path(cpp_extension._get_build_directory(_NAME, verbose=False))):
        cpp_extension.load(
            name=_NAME,
            sources=[str(path) for path in _SOURCES],
            extra_cflags=flags,
            extra_include_paths=[str(_DIR)],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold the build directory for this process, also against a loader that died in it.

    torch's own lock is a file whose mere existence makes every later loader wait: a
    process killed while loading (a worker killed at start, a check's phase at its
    deadline) left it behind, and every Baton process on the machine then hung at start.
    An flock dies with its holder; every Baton loader takes it first, so a torch lock
    found under it was left by a dead loader."""
    with open(build_dir / "baton.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a process that died while loading the CPU kernels", stale)
            stale.unlink(missing_ok=True)
        yield


def cpu_kernels_loaded() -> bool:
    """Whether this process has already loaded the kernels (never builds them)."""
    return load_cpu_kernels.cache_info().currsize > 0


@functools.cache
def cpu_kernels_available() -> bool:
    """Whether the CPU kernels build and load here. If not (no C++ compiler with OpenMP,
    say), False with one warning per process, and the plain-torch path serves: slower,
    the same tokens. Asked once: a failed build is not retried at every engine start."""
    try:
        load_cpu_kernels()
    except Exception as exc:  # compiler missing or failing: the torch path still works
        reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        logger.warning("Baton's CPU kernels did not build (%s): serving on the plain-torch path, which is "
                       "slower; install a C++ compiler with OpenMP (g++ or clang with libomp), then run "
                       "`make kernels`", reason[:300])
        return False
    return True


def paged_decode_attention(
    query: torch.Tensor,  # [D, H, Dh]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KvH, Dh]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [D, max_blocks] int64
    seq_lens: torch.Tensor,  # [D] int64
    scale: float,
    out: torch.Tensor,  # [D, H, Dh], written
) -> None:
    torch.ops.baton.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out)


def rms_norm(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm on [N, hidden] in one pass."""
    return torch.ops.baton.rms_norm(input, weight, eps)


def rotary_embedding_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
    """Rotate-half RoPE in place on heads [0, num_heads) of x [N, heads, Dh]; cos/sin [N, Dh]."""
    torch.ops.baton.rotary_embedding_(x, cos, sin, num_heads)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [N, 2I] holding gate then up columns."""
    return torch.ops.baton.silu_and_mul(gate_up)


def argmax_rows(input: torch.Tensor) -> torch.Tensor:
    """Per-row argmax of [N, V] with torch.argmax's rules (first max, NaN wins)."""
    return torch.ops.baton.argmax_rows(input)


# Output columns of a panel of packed expert weights (cpu_ops.cpp's kPanel).
MOE_PANEL = 32


def pack_moe_weights(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's stacked experts, gate_up [E, 2I, H] (gate rows, then up rows) and down
    [E, H, I], in the panels `moe_experts` streams: [E, ceil(I / 16), H, 32], each panel
    16 gate columns then the same 16 up columns, and [E, ceil(H / 32), I, 32]; columns
    past I or H are zeros. Each panel is [K, 32] contiguous, so a panel is one read."""
    experts, two_i, hidden = gate_up.shape
    half = MOE_PANEL // 2

    def panels(weight: torch.Tensor, width: int) -> torch.Tensor:  # [E, N, K] -> [E, ceil(N / width), K, width]
        rows = weight.shape[1]
        weight = torch.nn.functional.pad(weight, (0, 0, 0, -rows % width))
        return weight.unflatten(1, (-1, width)).transpose(2, 3)

    gate, up = gate_up[:, : two_i // 2], gate_up[:, two_i // 2:]
    packed_gate_up = torch.cat([panels(gate, half), panels(up, half)], dim=3).contiguous()
    return packed_gate_up, panels(down, MOE_PANEL).contiguous()


def moe_experts(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, intermediate: int) -> torch.Tensor:
    """A MoE layer's SwiGLU experts in float32: hidden [N, H], each token's experts
    expert_ids [N, k] (int64) and routing weights [N, k], the weights packed by
    `pack_moe_weights`, each expert's width `intermediate` -> [N, H]: each token's
    experts' outputs times their weights, summed in ascending expert order."""
    return torch.ops.baton.moe_experts(hidden, expert_ids, weights, gate_up, down, intermediate)
