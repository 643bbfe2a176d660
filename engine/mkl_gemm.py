"""MKL's packed float32 GEMM (``cblas_sgemm_pack`` once, ``cblas_sgemm_compute`` per call), reached through
the symbols torch's own CPU library (``libtorch_cpu.so``, which links MKL in) exports: a linear layer's
weight is packed into MKL's kernel layout once, at load, and every call after multiplies by it as it is.

Why: ``F.linear(x, W)`` runs MKL's sgemm, which copies the weight's panels into that layout again on
every call; a oneDNN-packed weight (``packed_linear.py``'s other kind) saves that copy at decode batches
but not at a prefill's hundreds of rows. Measured on the 122M peer checkpoint's shapes (one thread,
Intel Xeon with AVX-512, 2026-12-06; the sum over q, k, gate, down and a merged gate|up weight, ms of
F.linear and the ratio of each packed copy to it; MKL's packed once at 512 rows, oneDNN's at 8):

    rows       1      4      8     64    512   2048
    F.linear   2.22   4.39   7.05  14.45  88.7   351.5
    MKL        1.21x  0.74x  0.51x  0.77x  0.91x  0.94x
    oneDNN     1.41x  0.65x  0.52x  0.82x  1.06x  1.07x

(``packed_linear.linear`` keeps F.linear up to ``PLAIN_MAX_ROWS`` rows.) At a prefill's rows oneDNN's
copy is slower than F.linear and MKL's 9% faster; over a CPU layer's unmerged projections at 4 rows the
two packed copies are within 2% of each other (oneDNN's gate and down faster, MKL's q and o).

The packed buffer does not depend on the row count it is used at (``cblas_sgemm_pack_get_size`` gives
the same size for every hint, and ``available`` checks a product), so one copy serves a decode step of
4 rows and a prefill of 2048. It is larger than the weight: about 9 MiB more per matrix (1.1x of a
4096 x 11008 weight, 3.3x of a 1024 x 1024 one); ``EngineConfig.packed_linear`` off drops it.

``available()`` is decided once per process: the three symbols found, and one small product through them
equal to ``F.linear``'s (a torch without MKL, or an MKL with 64-bit integers behind these names, leaves it
off, and ``packed_linear`` uses oneDNN's packing instead). ctypes releases the GIL for each call, as
torch's own ops do.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162  # CBLAS enum values
_INT = ctypes.c_int  # MKL_INT of the LP64 interface torch links (checked by available())
PACK_ROWS_HINT = 512  # the rows ``pack`` tells MKL to expect (as measured above; the buffer is the same size for any)


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[n, k]`` (out, in) in MKL's packed layout (``buf``: bytes MKL sized and wrote)."""
    buf: torch.Tensor
    n: int
    k: int

    @property
    def dtype(self) -> torch.dtype:
        """What it multiplies (as a oneDNN-packed tensor's ``dtype`` says, for ``packed_linear``)."""
        return torch.float32


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL | None:
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    get_size.restype = ctypes.c_size_t
    get_size.argtypes = [_INT] * 4
    pack.restype = None
    pack.argtypes = [_INT] * 6 + [ctypes.c_float, ctypes.c_void_p, _INT, ctypes.c_void_p]
    compute.restype = None
    compute.argtypes = [_INT] * 6 + [ctypes.c_void_p, _INT, ctypes.c_void_p, _INT, ctypes.c_float,
                                     ctypes.c_void_p, _INT]
    return lib


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether MKL's packed GEMM can be called here and gives F.linear's product (checked once)."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 24, generator=g), torch.randn(5, 24, generator=g)
    try:
        got = linear(x, pack(w), None)
    except (RuntimeError, ValueError):
        return False
    return bool(torch.allclose(got, F.linear(x, w), atol=1e-4, rtol=1e-4))


def pack(w: torch.Tensor) -> PackedWeight:
    """``w`` ([out, in], float32 on CPU) packed for ``linear``."""
    lib = _lib()
    if lib is None or w.dtype != torch.float32 or w.dim() != 2 or w.device.type != "cpu":
        raise ValueError(f"MKL packs float32 2-D CPU weights only (got {w.dtype} {tuple(w.shape)} on {w.device})")
    w = w.detach().contiguous()
    n, k = w.shape
    buf = torch.empty(lib.cblas_sgemm_pack_get_size(_B_MATRIX, PACK_ROWS_HINT, n, k), dtype=torch.uint8)
    lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, PACK_ROWS_HINT, n, k, 1.0, w.data_ptr(), k, buf.data_ptr())
    return PackedWeight(buf, n, k)


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` [rows, in] float32 and ``packed = pack(W)``."""
    n, k = packed.n, packed.k
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32:
        raise ValueError(f"x must be float32 [rows, {k}], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    if rows:
        _lib().cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, rows, n, k,  # type: ignore[union-attr]
                                   x.data_ptr(), k, packed.buf.data_ptr(), k, 0.0, out.data_ptr(), n)
    return out if bias is None else out.add_(bias)
