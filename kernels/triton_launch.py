"""How a Triton kernel of loraplex is launched: compiled on CUDA, interpreted on the CPU.

`triton.jit` decides between compiling and interpreting when a function is *defined*, from
TRITON_INTERPRET; so does Triton's own standard library (tl.zeros, tl.sum, ...) when triton is
first imported. That made the CPU path depend on import order: peft imports triton, so a test
session that imported peft before setting the variable got compiled kernels and failed on CPU
tensors. So each kernel here keeps both forms and picks by the device of the tensors it is
launched on: CPU tensors always run in Triton's interpreter (the same interpreter that
TRITON_INTERPRET=1 selects), CUDA tensors run compiled unless TRITON_INTERPRET=1 asks for the
interpreter everywhere.

For an interpreted launch of a kernel whose callees (Triton's standard library) were defined
compiled, JITFunction.__call__ is pointed at an interpreted copy of the callee for the duration
of the launch. Calling a JITFunction from host code is otherwise always an error
("Cannot call @triton.jit'd outside of the scope of a kernel"), so nothing that works is changed,
and compiled launches do not go through __call__ at all.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction, _patch_lang
from triton.runtime.jit import JITFunction

try:
    from triton.runtime.errors import InterpreterError
except ImportError:  # older Triton
    InterpreterError = RuntimeError  # type: ignore[misc,assignment]


_INTERPRETED_CALLEES: dict[Callable[..., Any], Callable[..., Any]] = {}


def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    """JITFunction.__call__ during an interpreted launch: run the callee's interpreted body.

    Triton's own InterpretedFunction.__call__ re-patches triton.language on every call (about 2 ms
    each, most of an interpreted program's time) and never undoes it; the launch patches once
    instead (see _callees_interpreted)."""
    fn = _INTERPRETED_CALLEES.get(self.fn)
    if fn is None:
        interpreted = InterpretedFunction(self.fn)
        rewrite = getattr(interpreted, "rewrite", None)  # absent in older Triton: it patches per call
        fn = _INTERPRETED_CALLEES[self.fn] = rewrite() if rewrite is not None else interpreted
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise InterpreterError(repr(e)) from e


@contextmanager
def _callees_interpreted() -> Iterator[None]:
    # triton.language.core, which the standard library calls into, patched for the whole launch
    # (the launch itself patches triton.language) and restored after it.
    probe = getattr(tl.zeros, "fn", None)
    scope = _patch_lang(probe) if probe is not None else None  # older Triton returns no scope
    original = JITFunction.__call__
    JITFunction.__call__ = _call_interpreted
    try:
        yield
    finally:
        JITFunction.__call__ = original
        if scope is not None:
            scope.restore()


class _InterpretedLauncher:
    """`launcher[grid](*args)` like a JITFunction, run by the interpreter."""

    def __init__(self, fn: InterpretedFunction) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            with _callees_interpreted():
                return self.fn[grid](*args, **kwargs)

        return launch


class DualKernel:
    """One kernel body with a compiled and an interpreted launcher; `kernel.on(device)[grid](...)`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    @functools.cached_property
    def compiled(self) -> JITFunction:
        return JITFunction(self.fn)

    @functools.cached_property
    def interpreted(self) -> InterpretedFunction:
        return InterpretedFunction(self.fn)

    def on(self, device: torch.device) -> JITFunction | _InterpretedLauncher:
        if device.type != "cuda" or interpreting():
            return _InterpretedLauncher(self.interpreted)
        return self.compiled


def dual_kernel(fn: Callable[..., Any]) -> DualKernel:
    """Decorator used instead of @triton.jit for every kernel of loraplex."""
    return DualKernel(fn)


def interpreting() -> bool:
    """Whether TRITON_INTERPRET=1 asks for the interpreter on every device."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 (TF32 would cost ~1e-3 relative error,
    far outside the fp32 tolerance the engine's parity test holds); the default for half types."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def parallel_slots(device: torch.device) -> int:
    """About how many programs keep the device busy: 4 per SM on CUDA; the interpreter runs
    programs one after another, so there more programs only cost time."""
    if device.type == "cuda" and not interpreting():
        return 4 * num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 1


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides n, at most cap."""
    p = n & -n
    return min(p, cap)


__all__ = ["DualKernel", "dot_precision", "dual_kernel", "interpreting", "num_sms", "parallel_slots", "pow2_divisor", "triton"]
