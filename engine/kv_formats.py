"""The KV cache's element formats, ``--kv-cache-dtype``: the facts, torch-free (servers' flag parsing and
decode admission read them without loading torch).

* ``auto``: K and V rows of ``head_dim`` values in the model's dtype.
* ``fp8``: a row is ``head_dim`` bytes of float8_e4m3fn then its own 2-byte bfloat16 scale, one scale
  per token per KV head (``kv_quant.py`` quantizes and dequantizes; ``csrc/paged_decode.cpp`` reads
  the rows in place). Against 16-bit K/V that is ``2 * head_dim / (head_dim + 2)`` the tokens in the
  same bytes: 1.94x at head_dim 64, 1.97x at 128 (``tokens_per_byte_gain``).

Why a scale per token per KV head (not per block, nor per block per head): a row never changes after
its token is written, so decode filling a block token by token never re-quantizes what is there (a
per-block scale must, whenever a later token exceeds its range), and every row gets the whole fp8
range, the most accurate of the granularities. bfloat16 rather than float16 for the scale: float32's
range, so a tiny row's scale never underflows. Its 2 bytes are the price: 3% of a 64-wide row.
"""

from __future__ import annotations

from .defaults import KV_CACHE_DTYPES as KV_DTYPES

SCALE_BYTES = 2  # (cachestore/memory.py's FP8_SCALE_BYTES: the cachestore imports no engine; a test keeps them equal)


def check_kv_dtype(kv_dtype: str) -> str:
    """``kv_dtype`` if it is one of ``KV_DTYPES``, else ValueError naming the flag and the choices."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return kv_dtype


def describe(kv_dtype: str, model_dtype: str) -> str:
    """The KV cache's element type in words, for logs and refusals: "fp8 (float8_e4m3fn + a bfloat16
    scale per token per KV head)", or the model's dtype ("bfloat16")."""
    return "fp8 (float8_e4m3fn + a bfloat16 scale per token per KV head)" if kv_dtype == "fp8" else model_dtype


def row_nbytes(kv_dtype: str, head_dim: int, element_bytes: int) -> int:
    """Bytes of one (token, KV head) row of K or V; ``element_bytes``: the model dtype's (auto)."""
    return head_dim + SCALE_BYTES if kv_dtype == "fp8" else head_dim * element_bytes


def tokens_per_byte_gain(head_dim: int, element_bytes: int = 2) -> float:
    """How many more tokens an fp8 pool holds than one of ``element_bytes`` per value, in the same bytes."""
    return row_nbytes("auto", head_dim, element_bytes) / row_nbytes("fp8", head_dim, element_bytes)
