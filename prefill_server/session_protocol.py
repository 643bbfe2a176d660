"""What the prefill end of a Session is made of besides the stream itself: its errors, the
Deltas it yields, its timings, its fixed configuration, the observer it reports to, and the
pure helpers that build Session messages. ``decode_session.py`` (SessionRunner) uses them;
the node and the front ends catch the errors.

Errors, by when they happen:
- ``Retryable`` - before any token reached the client: the node tries another decode;
- ``DecodeFailed`` - after: the node resumes the request elsewhere or the client gets an error;
- ``NoDecodeAvailable`` - the node gives up (503 / UNAVAILABLE).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc

from pdserve.defaults import SESSION_TIMEOUT_S
from pdserve.engine import blocks_needed
from pdserve.engine.logprobs import TokenLogprob
from pdserve.protos import session_pb2 as pb
from pdserve.protos.logprobs import logprob_fields

if TYPE_CHECKING:
    from pdserve.engine import SamplingParams


class Retryable(Exception):
    """This decode cannot take the request (refused, unreachable, failed before any token)."""

    def __init__(self, reason: str, code: str = "decode_unreachable"):
        super().__init__(reason)
        self.reason, self.code = reason, code


class DecodeFailed(Exception):
    """The decode failed after tokens reached the client; ``code`` is the decode's Error code when it
    gave one (``kv_checksum_mismatch``: the KV arrived corrupted there), else "decode_failed"."""

    def __init__(self, reason: str, code: str = "decode_failed"):
        super().__init__(reason)
        self.code = code or "decode_failed"


class NoDecodeAvailable(Exception):
    """The request cannot be served now (no decode took it, no fallback, or prefill is full): 503."""


@dataclass(slots=True)
class Delta:
    """New tokens for the client; the last Delta of a request has ``finished`` set."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list | None = None  # one TokenLogprob per token (pdserve.engine.logprobs) when the request asked
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), on the first Delta only
    prompt_logprobs: list | None = None
    # prompt tokens a prefix cache held (not computed), on an attempt's first Delta: this prefill's engine's
    # when it computed the prompt, the decode's cached blocks when the decode computed it after them
    cached_tokens: int | None = None


@dataclass(slots=True)
class SessionTimings:
    """Monotonic timestamps of one P/D request (for metrics and the overlap test)."""

    start: float = field(default_factory=time.monotonic)
    arrived: float = 0.0  # when the request reached this prefill (before any wait in line; set by its conductor)
    allocated: float = 0.0
    prefill_done: float = 0.0
    kv_sent: float = 0.0
    layer_stored: list[float] = field(default_factory=list)
    layer_send_seconds: list[float] = field(default_factory=list)  # per layer: handed to the CacheStore -> delivered
    link_busy_s: float = 0.0  # time the link was busy with this request's KV (cost_model.link_busy_seconds)
    cached_blocks: int = 0  # leading prompt blocks the decode reused (its Allocation)
    where: str = "remote"  # where the prompt was computed: remote (here, KV moved) or local (on the decode)


def decode_reservation(n_prompt: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a decode reserves for a request: prompt + max_tokens, never preempted."""
    return blocks_needed(n_prompt + max_tokens, block_size)


def sampling_to_proto(sp: SamplingParams) -> pb.Sampling:
    """The engine's SamplingParams as the Session's Sampling message."""
    msg = pb.Sampling(
        max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or 0,
        stop=list(sp.stop or []), stop_token_ids=list(sp.stop_token_ids or []), ignore_eos=bool(sp.ignore_eos),
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    msg.seed_position = sp.seed_position
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    if sp.grammar is not None:
        msg.grammar.CopyFrom(pb.Grammar(kind=sp.grammar.kind, schema=sp.grammar.schema or "", feed=sp.grammar.feed))
    return msg


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(*logprob_fields(msg))


def first_token_finishes(token: int, sp: SamplingParams, eos_token_ids) -> str | None:
    """Finish reason if prefill's sampled token already ends the request, else None."""
    if token in (sp.stop_token_ids or ()) or (not sp.ignore_eos and token in eos_token_ids):
        return "stop"
    if sp.max_tokens <= 1:
        return "length"
    return None


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """The fixed facts of this prefill that every Session uses."""

    compat: pb.Compat  # sent in Start; decode refuses a mismatch
    block_size: int
    eos_token_ids: tuple[int, ...] = ()
    # KV push, each wait on decode's next message, and decode's wait for us (sent in Start)
    session_timeout_s: float = SESSION_TIMEOUT_S
    connect_timeout_s: float = 5.0  # Start -> Allocation
    layerwise_push: bool = True  # push each layer as it is written (False: all layers after the forward pass)
    out_of_blocks_error: type[Exception] = RuntimeError  # the engine's OutOfBlocksError
    reuse_prefix: bool = True  # ask decodes to reuse the prompt's cached prefix (Start.reuse_prefix)
    # with an SLO policy's admission line: prompt tokens our engine's line (remote prefills not computed yet)
    # holds before the admission line keeps the rest in the policy's order (the engine's step budget)
    line_tokens: int = 2048


class SessionObserver(Protocol):
    """Told what a Session did (picker accounting, measurements, metrics); see transfer_accounting.py."""

    def allocated(self, address: str, blocks_reserved: int) -> None: ...

    def prefilled(self, tokens: int, seconds: float) -> None: ...

    def transferred(self, timings: SessionTimings, moved_blocks: int) -> None: ...

    def computed_on_decode(self, reused_blocks: int, computed_blocks: int) -> None: ...




def rpc_reason(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
