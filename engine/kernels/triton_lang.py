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
"""

from __future__ import annotations

import triton
import triton.language as tl


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
