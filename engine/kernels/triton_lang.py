"""The few triton.language library functions Baton's kernels use, written with the core
builtins (`tl.reduce`, `tl.full`) instead of taken from `triton.language.standard`.

Why: under TRITON_INTERPRET=1 every @triton.jit function a kernel calls must have
been decorated while the variable was set, and triton's own standard library is
decorated when triton is first imported, which torch and transformers may do
before an engine on CPU asks for the interpreter. Functions defined here are
decorated when Baton's kernel modules are imported, after
`engine.envs.use_triton_interpreter` has set the variable, so the kernels run
under the interpreter whatever was imported first. On a GPU they compile to the
same reductions as `tl.sum` and `tl.max`.

Also here, applied at import under the interpreter only: the one fix Triton 3.6's
interpreter needs to run the kernels with numpy 2.4 or later (see below).
"""

from __future__ import annotations

import triton
import triton.language as tl


def _squeeze_scalar_index() -> None:
    """Triton 3.6's interpreter takes a scalar's `__index__` (a `range` bound in a kernel
    loop) as `int()` of its one-element array, which numpy 2.4 refuses ("only
    0-dimensional arrays can be converted"; triton-lang/triton#9171). Triton 3.8 and later
    squeeze the array first; this wraps the older interpreter's patching of `tl.tensor` to
    do the same, inside the scope the interpreter restores after each launch."""
    from triton.runtime import interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor

    def squeezing_patch_lang_tensor(tensor, scope) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = squeezing_patch_lang_tensor


# knobs.runtime.interpret: what triton.jit reads (TRITON_INTERPRET, set by engine.envs).
if triton.knobs.runtime.interpret and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 8):
    _squeeze_scalar_index()


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def sum_along(x, axis: tl.constexpr):
    """tl.sum(x, axis) for float inputs (no integer promotion)."""
    return tl.reduce(x, axis, _add)


@triton.jit
def max_along(x, axis: tl.constexpr):
    """tl.max(x, axis) for values without NaN."""
    return tl.reduce(x, axis, _maximum)


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def grouped_tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (row tile, column tile), GROUP_M row tiles walking the columns
    together so that their weight tiles are read from L2 while still there."""
    pid = tl.program_id(0)
    num_pid_m = cdiv(M, BLOCK_M)
    num_pid_n = cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_rows
    pid_n = (pid % num_pid_in_group) // group_rows
    return pid_m, pid_n
