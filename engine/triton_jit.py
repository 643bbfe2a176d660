"""Triton, imported lazily, and kernel bodies decorated once per mode (interpreter or compiler).

The engine's Triton kernels (``gpu_attention.py``, ``gpu_elementwise.py``) are written as plain
functions. ``kernels(bodies, interpret)`` decorates a module's bodies with ``triton.jit`` for CPU
tensors (Triton's interpreter: how the tests check them without a GPU) or CUDA tensors (the
compiler), once per (module, mode), in the same process, without the caller setting
``TRITON_INTERPRET`` (``triton.jit`` reads it at decoration time; it is restored after). Each
body runs with a private globals dict in which ``tl`` is ``triton.language``; triton.language's
own jit helpers (tl.max, tl.sum, tl.cdiv, tl.zeros) were decorated for ONE mode when triton was
imported, so the bodies call none of them: reductions are ``tl.reduce`` with the combine
functions of ``tl.standard``, the rest is written out.

Where triton is missing (the CPU image) this module still imports; ``available()`` is False and
``kernels`` raises RuntimeError naming why.
"""

from __future__ import annotations

import builtins
import os
import threading
import types
from types import SimpleNamespace
from typing import Any, Callable

INTERPRET_ENV = "TRITON_INTERPRET"
COMBINE_FNS = ("_elementwise_max", "_sum_combine")  # the reductions' combine functions, from triton

_lock = threading.Lock()
_state: dict = {}  # "triton": (triton, triton.language) or "error": why not; (bodies, mode) -> kernels


def triton_modules():
    """(triton, triton.language), imported once; RuntimeError naming why where it cannot be."""
    found = _state.get("triton")
    if found is not None:  # the common case, per norm and rotary call on CUDA: no lock
        return found
    with _lock:
        if "triton" not in _state and "error" not in _state:
            try:
                import triton
                import triton.language as tl
            except Exception as exc:  # ImportError, or a broken install
                _state["error"] = f"triton cannot be imported: {exc!r}"
            else:
                missing = [name for name in COMBINE_FNS if not hasattr(tl.standard, name)]
                if missing:
                    _state["error"] = f"triton {triton.__version__} has no tl.standard.{', '.join(missing)}"
                else:
                    _state["triton"] = (triton, tl)
    if "error" in _state:
        raise RuntimeError(_state["error"])
    return _state["triton"]


def available() -> bool:
    """Whether triton imports here."""
    try:
        triton_modules()
    except RuntimeError:
        return False
    return True


def kernels(bodies: tuple[Callable[..., Any], ...], interpret: bool) -> SimpleNamespace:
    """``bodies`` decorated for the interpreter (CPU tensors) or the compiler, once per mode; each
    kernel is named after its body without the leading underscore."""
    triton, tl = triton_modules()
    key = (bodies, interpret)
    with _lock:
        if key not in _state:
            saved = os.environ.get(INTERPRET_ENV)
            if interpret:
                os.environ[INTERPRET_ENV] = "1"
            else:
                os.environ.pop(INTERPRET_ENV, None)
            try:
                scope = {"__name__": bodies[0].__module__, "__builtins__": builtins, "tl": tl}
                _state[key] = SimpleNamespace(**{
                    body.__name__.lstrip("_"): triton.jit(_rebind(body, scope)) for body in bodies})
            finally:
                if saved is None:
                    os.environ.pop(INTERPRET_ENV, None)
                else:
                    os.environ[INTERPRET_ENV] = saved
        return _state[key]


def _rebind(body: Callable[..., Any], scope: dict) -> types.FunctionType:
    """``body`` with ``scope`` as its globals (same code, so triton still finds its source)."""
    if not isinstance(body, types.FunctionType):
        raise TypeError(f"a kernel body must be a plain Python function, got {body!r}")
    fn = types.FunctionType(body.__code__, scope, body.__name__, body.__defaults__, body.__closure__)
    fn.__annotations__ = dict(body.__annotations__)
    fn.__qualname__, fn.__module__ = body.__qualname__, body.__module__
    return fn
