"""Admission on decode: whether a Session's ``Start`` may be served here (pure, no I/O).

Contract of ``refusal(start, ...)``: None when the request may go on to reserve blocks,
else ``(code, reason)`` for the ``Refusal`` message. The checks, in order:

1. ``bad_request`` - no request id;
2. ``version`` - the protocol versions differ;
3. ``incompatible`` - a KV layout field differs (``compat_mismatch`` names each, both values; a
   different --kv-cache-dtype is named in words first: "decode's KV cache is fp8 (...), this
   prefill's is float32"); or the two tensor-parallel sizes do not pair (``tp/heads.pairing_error``:
   their KV head shards must nest; the message names both sizes);
4. ``draining`` - this decode is shutting down;
5. ``bad_request`` - the request id already has a live session here, the prompt is empty,
   max_tokens < 1, prompt + max_tokens exceed the context, or ``blocks_needed`` does not
   match the prompt;
6. ``too_large`` - prompt + max_tokens need more blocks than the whole pool: it can never
   fit, so prefill should not wait for it. With a KV pool (``--kv-pool``) the whole pool is
   this decode's plus the most its peers ever lend (``pool_blocks``), for the requests the
   pooled path serves (``pooled_refusal`` None: greedy, no stop strings, logprobs or grammar).

"Not enough free blocks now" (``out_of_blocks``, transient) is the engine's answer to
``reserve``, not decided here.
"""

from __future__ import annotations

from pdserve.engine import blocks_needed, kv_formats
from pdserve.engine.tp.heads import pairing_error
from pdserve.protos import session_pb2 as pb
from pdserve.protos.version import PROTOCOL_VERSION

# Compat fields that must be equal on both ends for KV bytes to be meaningful (kv_cache_dtype too: kv_dtype).
COMPAT_FIELDS = ("dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "model", "transport")


def kv_dtype(compat: pb.Compat) -> str:
    """The Compat's --kv-cache-dtype ("auto" when an older peer left it unset)."""
    return compat.kv_cache_dtype or "auto"


def describe_kv(compat: pb.Compat) -> str:
    """The KV cache's element type in words: 'fp8 (float8_e4m3fn + ...)' or the model dtype."""
    return kv_formats.describe(kv_dtype(compat), compat.dtype)


def compat_mismatch(ours: pb.Compat, theirs: pb.Compat) -> str | None:
    """None when compatible, else a message naming every differing field with both values."""
    diffs = [
        f"{name}: prefill={getattr(theirs, name)!r} decode={getattr(ours, name)!r}"
        for name in COMPAT_FIELDS
        if getattr(ours, name) != getattr(theirs, name)
    ]
    if kv_dtype(ours) != kv_dtype(theirs):
        diffs.insert(0, f"decode's KV cache is {describe_kv(ours)}, this prefill's is {describe_kv(theirs)} "
                        f"(--kv-cache-dtype: prefill={kv_dtype(theirs)!r} decode={kv_dtype(ours)!r})")
    if diffs:
        return "incompatible KV layout: " + ", ".join(diffs)
    pairing = pairing_error(ours.num_kv_heads, theirs.tensor_parallel_size or 1, ours.tensor_parallel_size or 1)
    return None if pairing is None else "incompatible tensor parallelism: " + pairing


def refusal(start: pb.Start, compat: pb.Compat, *, max_model_len: int, total_blocks: int, draining: bool,
            has_session: bool, pool_blocks: int = 0, pooled_refusal: str | None = None) -> tuple[str, str] | None:
    """(code, reason) when decode must refuse ``start``; None when it may reserve blocks."""
    rid = start.request_id
    if not rid:
        return "bad_request", "Start has no request_id"
    if start.protocol_version != PROTOCOL_VERSION:
        return "version", f"protocol version: prefill={start.protocol_version} decode={PROTOCOL_VERSION}"
    mismatch = compat_mismatch(compat, start.compat)
    if mismatch:
        return "incompatible", mismatch
    if draining:
        return "draining", "decode is draining (shutting down)"
    if has_session:
        return "bad_request", f"request id {rid!r} already has a session on this decode"
    n_prompt, max_tokens = len(start.prompt_token_ids), start.sampling.max_tokens
    if n_prompt == 0 or max_tokens < 1 or n_prompt + max_tokens > max_model_len:
        return ("bad_request",
                f"prompt of {n_prompt} tokens + max_tokens {max_tokens} does not fit the context of {max_model_len}")
    if start.blocks_needed != blocks_needed(n_prompt, compat.block_size):
        return ("bad_request", f"blocks_needed {start.blocks_needed} does not match {n_prompt} prompt tokens "
                               f"in blocks of {compat.block_size}")
    need = blocks_needed(n_prompt + max_tokens, compat.block_size)
    if need > total_blocks:
        why = f"request needs {need} KV blocks ({n_prompt} prompt tokens + max_tokens {max_tokens})"
        if pool_blocks <= 0:
            return "too_large", f"{why} but this decode has only {total_blocks} in all"
        if pooled_refusal is not None:
            return ("too_large", f"{why}: more than this decode's {total_blocks}, and its KV pool cannot serve "
                                 f"{pooled_refusal}")
        if need > total_blocks + pool_blocks:
            return ("too_large", f"{why} but this decode has only {total_blocks} in all and its KV pool lends "
                                 f"at most {pool_blocks} more")
    return None


def pooled_refusal(start: pb.Start) -> str | None:
    """Why the KV pool's path cannot serve ``start`` (it is greedy, with token-level stops
    only), or None."""
    sampling = start.sampling
    why = [name for name, bad in (("temperature > 0 (the pooled path is greedy)", sampling.temperature > 0),
                                  ("stop strings", bool(sampling.stop)), ("logprobs", sampling.HasField("logprobs")),
                                  ("a grammar", sampling.HasField("grammar"))) if bad]
    return ", ".join(why) or None
