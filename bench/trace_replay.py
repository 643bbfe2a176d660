"""Real request traces as load: read, window, scale, and turn into prompts whose shared prefixes stay shared.

Pure functions (no I/O but reading the trace file), unit-tested without a server. Two formats:

- ``mooncake``: Mooncake's JSONL (``MOONCAKE_TRACE``: bench/traces/, its README names source and licence), one request
  per line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``.
  Each hash id stands for one ``TRACE_BLOCK_TOKENS``-token block of the prompt (the last one may be
  partial); two requests that share leading ids share that prefix.
- ``azure``: the CSV shape of Azure's public LLM inference traces, a header and one request per row:
  ``TIMESTAMP,ContextTokens,GeneratedTokens`` (the timestamp a date-time, or seconds) or
  ``timestamp,input_length,output_length``. No block ids: no two prompts share a prefix.

A replay (``replay_requests``) keeps the trace's structure and says how it was scaled:

1. **window**: the requests arriving in ``[start_s, start_s + duration_s)`` of the trace (all by
   default), at most ``max_requests`` of them, their times made relative to the window's start.
2. **time**: each arrival offset is multiplied by ``time_scale`` (0.1: ten times the rate).
3. **lengths**: prompt and output lengths are multiplied by ``length_scale`` (at least 1 token); a
   hash id becomes a block of ``round(TRACE_BLOCK_TOKENS * length_scale)`` tokens, so the block
   structure scales with the prompt: a prompt of n ids is n blocks long before and after. Then
   ``max_prompt_tokens`` / ``max_output_tokens`` cut what is still too long for the model (a cut
   prompt keeps its leading blocks, so what it shares with others stays shared).
4. **tokens**: each hash id maps to a fixed block of token ids drawn from ``pool`` by a generator
   seeded with (seed, id): equal ids give equal tokens in every request and every run with that
   seed, different ids (almost surely) different ones. A prompt is its blocks in order, cut to its
   scaled length; tokens past its blocks (a trace whose length exceeds its ids) and every prompt
   of a trace without ids are drawn per request.

A trace file may be xz- or gzip-compressed (``.xz``, ``.gz``): it is read as it is.

``Scaling.describe()`` is the one line every result names.
"""

from __future__ import annotations

import csv
import gzip
import json
import lzma
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from .loadgen_workload import RequestSpec

TRACE_BLOCK_TOKENS = 512  # tokens one Mooncake hash id stands for
MOONCAKE_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation_trace.jsonl.xz"  # bench/traces
FORMATS = ("mooncake", "azure")
_AZURE_COLUMNS = (("TIMESTAMP", "ContextTokens", "GeneratedTokens"), ("timestamp", "input_length", "output_length"))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of a trace: arrival (seconds from the trace's start), lengths, prompt block ids."""

    time_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Scaling:
    """How a trace was cut and scaled for this box (see the module docstring)."""

    time_scale: float = 1.0
    length_scale: float = 1.0
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    max_prompt_tokens: int | None = None  # after scaling, a longer prompt is cut (its leading blocks stay)
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time scale must be > 0, got {self.time_scale}")
        if not 0 < self.length_scale <= 1:
            raise ValueError(f"length scale must be in (0, 1], got {self.length_scale}")
        if self.start_s < 0:
            raise ValueError(f"window start must be >= 0 s, got {self.start_s}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"window duration must be > 0 s, got {self.duration_s}")
        for name in ("max_requests", "max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be >= 1, got {value}")

    @property
    def block_tokens(self) -> int:
        """Tokens one hash id becomes after scaling."""
        return max(1, round(TRACE_BLOCK_TOKENS * self.length_scale))

    def describe(self) -> str:
        window = (f"window {self.start_s:g}s+{self.duration_s:g}s" if self.duration_s is not None
                  else f"from {self.start_s:g}s")
        cap = f", first {self.max_requests} requests" if self.max_requests is not None else ""
        cut = "".join(f"; {what} cut at {n} tokens" for what, n in (("prompts", self.max_prompt_tokens),
                                                                       ("outputs", self.max_output_tokens)) if n)
        return (f"trace {window}{cap}; time x{self.time_scale:g}; lengths x{self.length_scale:g} "
                f"(a hash id = {self.block_tokens} tokens){cut}")


def read_trace(path: Path, fmt: str) -> list[TraceRequest]:
    """Every request of a ``mooncake`` or ``azure`` trace, in arrival order; errors name the line."""
    if fmt not in FORMATS:
        raise ValueError(f"trace format must be one of {FORMATS}, got {fmt!r}")
    reqs = _read_mooncake(Path(path)) if fmt == "mooncake" else _read_azure(Path(path))
    if not reqs:
        raise ValueError(f"{path}: no requests in the trace")
    return sorted(reqs, key=lambda r: r.time_s)


def open_text(path: Path, newline: str | None = None):
    """A trace file opened as UTF-8 text, decompressed on the fly when its name ends in ``.xz`` or ``.gz``."""
    path = Path(path)
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8", newline=newline)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline=newline)
    return open(path, encoding="utf-8", newline=newline)


def _positive_int(value, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {what} must be an integer >= 1, got {value!r}")
    return value


def _read_mooncake(path: Path) -> list[TraceRequest]:
    out = []
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
                ts, ids = row["timestamp"], row.get("hash_ids", [])
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{where}: expected {{\"timestamp\": ms, \"input_length\": n, \"output_length\": n, "
                                 f"\"hash_ids\": [...]}}: {e!r}") from None
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
                raise ValueError(f"{where}: timestamp must be a number of milliseconds >= 0, got {ts!r}")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError(f"{where}: hash_ids must be a list of integers")
            out.append(TraceRequest(ts / 1000.0, _positive_int(row.get("input_length"), "input_length", where),
                                    _positive_int(row.get("output_length"), "output_length", where), tuple(ids)))
    return out


def _seconds(value: str, where: str) -> float:
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value.strip()).timestamp()
    except ValueError:
        raise ValueError(f"{where}: timestamp {value!r} is neither seconds nor a date-time") from None


def _read_azure(path: Path) -> list[TraceRequest]:
    with open_text(path, newline="") as f:
        reader = csv.DictReader(f)
        header = tuple(reader.fieldnames or ())
        cols = next((c for c in _AZURE_COLUMNS if set(c) <= set(header)), None)
        if cols is None:
            raise ValueError(f"{path}: the header must name {' or '.join(','.join(c) for c in _AZURE_COLUMNS)}; "
                             f"it has {','.join(header) or 'nothing'}")
        rows = []
        for lineno, row in enumerate(reader, 2):
            where = f"{path}:{lineno}"
            try:
                n_in, n_out = int(row[cols[1]]), int(row[cols[2]])
            except (TypeError, ValueError):
                raise ValueError(f"{where}: {cols[1]} and {cols[2]} must be integers") from None
            rows.append((_seconds(row[cols[0]], where), _positive_int(n_in, cols[1], where),
                         _positive_int(n_out, cols[2], where)))
    t0 = min((t for t, _, _ in rows), default=0.0)
    return [TraceRequest(t - t0, n_in, n_out) for t, n_in, n_out in rows]


def window(reqs: list[TraceRequest], scaling: Scaling) -> list[TraceRequest]:
    """The requests of the window, times relative to its start (step 1 of the module docstring)."""
    end = None if scaling.duration_s is None else scaling.start_s + scaling.duration_s
    picked = [r for r in reqs if r.time_s >= scaling.start_s and (end is None or r.time_s < end)]
    if scaling.max_requests is not None:
        picked = picked[: scaling.max_requests]
    if not picked:
        raise ValueError(f"no request of the trace arrives in its {scaling.describe()}")
    return [TraceRequest(r.time_s - scaling.start_s, r.input_length, r.output_length, r.hash_ids) for r in picked]


def block_tokens(hash_id: int, n: int, pool: list[int], seed: int) -> list[int]:
    """The n token ids hash id ``hash_id`` stands for: the same for the same (id, n, pool, seed)."""
    rng = random.Random(f"{seed}:{hash_id}")
    return [pool[rng.randrange(len(pool))] for _ in range(n)]


def replay_requests(reqs: list[TraceRequest], scaling: Scaling, pool: list[int],
                    seed: int = 0) -> tuple[list[RequestSpec], list[float]]:
    """The window's requests as prompts of token ids and their arrival offsets (seconds), scaled."""
    if not pool:
        raise ValueError("no token ids to build prompts from (give a tokenizer or a vocabulary size)")
    picked = window(reqs, scaling)
    bt = scaling.block_tokens
    blocks: dict[int, list[int]] = {}
    specs, arrivals = [], []
    for i, r in enumerate(picked):
        n_in = min(max(1, round(r.input_length * scaling.length_scale)), scaling.max_prompt_tokens or 1 << 62)
        n_out = min(max(1, round(r.output_length * scaling.length_scale)), scaling.max_output_tokens or 1 << 62)
        ids: list[int] = []
        for h in r.hash_ids:
            if len(ids) >= n_in:
                break
            if h not in blocks:
                blocks[h] = block_tokens(h, bt, pool, seed)
            ids += blocks[h]
        if len(ids) < n_in:  # no ids (azure), or a length past its ids: this request's own tokens
            rng = random.Random(f"{seed}:request:{i}")
            ids += [pool[rng.randrange(len(pool))] for _ in range(n_in - len(ids))]
        specs.append(RequestSpec(n_in, n_out, prompt_ids=tuple(ids[:n_in])))
        arrivals.append(r.time_s * scaling.time_scale)
    return specs, arrivals
