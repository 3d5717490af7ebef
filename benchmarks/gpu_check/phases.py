"""The GPU check's five phases: what each runs on a GPU and on a CPU, and its share of the
budget. A phase runs in a process of its own (`python -m benchmarks.gpu_check.phase NAME`),
in a process group of its own, killed at its deadline.

The test phases run Baton's own tests, chosen per device: on a GPU the part of the GPU suite
(`make test-gpu`, about 15 minutes) that proves the most in the budget, with several pytest
workers at once where the tests allow, since Triton's compiles dominate; on a CPU a
cross-section that runs in about a minute under Triton's interpreter. The tests are the
checks: a failure here is a failing test. The kernels include the fused MoE and the FP8
GEMMs (tests/kernels/test_triton_moe.py, test_triton_fp8.py), and the engine Qwen3, its
mixture of experts and FP8 on the GPU (tests/gpu/test_gpu_models.py). Left to `make
test-gpu`: the colocated `baton up` (the figures phase serves colocated), the sampler's sync
check, the overlap loop (CPU-only by design) and the attention tests' Triton cases (the
kernel tests cover them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_check.records import FAIL, PHASE_ENV, RECORDS_ENV, CheckLog

# Set in a phase's environment to make it hang (tests of the runner's deadline handling),
# after it started a process in a session of its own, as a test's server may be.
HANG_ENV = "BATON_GPU_CHECK_HANG"
PLANTED_SERVER = "baton-gpu-check planted server"

# pytest arguments per device. The kernel and engine tests compile many Triton variants: on a
# GPU several pytest workers (pytest-xdist) compile at once. The handoff tests start servers
# that take shares of the GPU's memory: one at a time. tests/gpu/test_gpu_memory.py (the KV
# cache's sizing, on made-up memory readings) runs on CPU only: nothing in it needs a GPU.
KERNEL_TESTS = {
    "cuda": ["tests/kernels/test_triton_kernels.py", "tests/kernels/test_triton_moe.py", "tests/kernels/test_triton_fp8.py",
             "-n", "8"],
    "cpu": ["tests/kernels/test_triton_kernels.py", "tests/kernels/test_triton_moe.py", "tests/kernels/test_triton_fp8.py",
            "-k",
            "(test_paged_attention_matches_dense_reference and kv1-g8-d64-bs16-tile32 and (decode or chunks or mixed))"
            " or test_split_kv_matches_single_pass[3 or test_table_stride_read_from_memory[3]"
            " or (test_rope_and_store_kv and dtype0) or test_add_rms_norm[576"
            # the fused MoE on FP8 weights per channel in float32 (~2 s interpreted); Fp8Linear on block scales
            " or test_fused_moe_fp8[per_channel-dtype0] or test_fp8_linear_forward[block_size1-dtype0]"],
}
ENGINE_TESTS = {
    "cuda": ["tests/gpu/test_gpu.py", "-m", "not gpu_servers", "tests/engine/test_triton_engine.py", "tests/gpu/test_gpu_sampling.py",
             "tests/engine/test_decode_graphs.py", "tests/gpu/test_gpu_spec.py", "tests/gpu/test_gpu_models.py", "-n", "4"],
    # On CPU a check of the phase, not of the engine (make test runs these tests itself):
    # the quick ones, not the interpreted Triton parity (19 s of CI's serial phase).
    "cpu": ["tests/engine/test_decode_graphs.py::test_a_step_is_written_as_the_layout_says",
            "tests/engine/test_decode_graphs.py::test_graphs_at_llama_8b_shapes_follow_the_longest_context",
            "tests/engine/test_overlap.py::test_a_stop_token_ends_the_stream_without_the_step_after",
            "tests/gpu/test_gpu_memory.py"],
}
HANDOFF_TESTS = {
    # Colocated serving on the GPU: the figures phase's serving section.
    "cuda": ["tests/gpu/test_gpu_handoff.py"],
    # On CPU, as the engine's: the ipc transport between processes, not `baton up` over it
    # (make test's serial phase runs that, and the figures phase serves disaggregated).
    "cpu": ["tests/kvtransfer/test_kv_ipc.py::test_ipc_transfers_are_bitwise_and_touch_nothing_else[small]",
            "tests/kvtransfer/test_kv_ipc.py::test_a_sender_killed_mid_copy_fails_the_receiver_at_once_and_leaves_nothing_behind",
            "tests/kvtransfer/test_kv_ipc.py::test_a_receiver_killed_mid_transfer_leaves_the_sender_serving"],
}


@dataclass(frozen=True)
class Phase:
    name: str
    title: str
    weight: float  # its share of the budget left when it starts, against the later phases'
    run: Callable[[CheckLog, str, Path], None]  # (log, device, work directory)


def _pytest(selection: dict[str, list[str]]) -> Callable[[CheckLog, str, Path], None]:
    def run(log: CheckLog, device: str, work: Path) -> None:
        import pytest

        os.environ[RECORDS_ENV], os.environ[PHASE_ENV] = str(log.path), log.phase
        # A test module that does not import on this machine is a failed check, not the end of the phase.
        code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "benchmarks.gpu_check.pytest_records", "-rfE",
                            "--durations=10", "--continue-on-collection-errors", *selection[device]])
        # 1: tests failed, each its own check; 2: interrupted (the phase's deadline: the runner says so).
        if code not in (0, 1, 2):
            log.add("pytest", FAIL, detail=f"pytest exited with {code!s} (3: internal error, 4: usage, "
                                             "5: no tests collected)")

    return run


def _environment(log: CheckLog, device: str, work: Path) -> None:
    from benchmarks.gpu_check import environment

    environment.run(log, device, work)


def _figures(log: CheckLog, device: str, work: Path) -> None:
    from benchmarks.gpu_check import figures

    figures.run(log, device, work)


PHASES = (
    Phase("environment", "GPU, driver, versions, every module importable", 0.08, _environment),
    # The kernels' and the engine's shares grew with the MoE and FP8 tests (about twice the
    # kernel tests: unmeasured on a GPU); the figures, last, get whatever time is left.
    Phase("kernels", "Triton kernels against torch (bf16, fp16, fp32 on a GPU), fused MoE, FP8", 0.2,
          _pytest(KERNEL_TESTS)),
    Phase("engine", "greedy parity (Llama, Qwen3, MoE), FP8 against bf16, graphs + overlap and eager, "
          "preemption, one wait a step", 0.22, _pytest(ENGINE_TESTS)),
    Phase("handoff", "CUDA IPC between processes, killed peers, baton up disaggregated", 0.2,
          _pytest(HANDOFF_TESTS)),
    Phase("figures", "bandwidth, decode latency, graphs, GPU idle, offline throughput, P/D serving, MoE and FP8",
          0.3, _figures),
)
PHASE_NAMES = tuple(phase.name for phase in PHASES)
