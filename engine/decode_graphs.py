"""DecodeGraphs: pure-decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step at small batch is bound by the host: ~30 kernels a layer, each launched from
Python. Captured once into a CUDA graph, the whole forward (embedding, every layer, the LM
head) is one launch. The graph reads fixed input buffers, so every step first copies its
inputs there:

1. **bucket**: the step's B decode rows run in the smallest bucket >= B (``BUCKETS`` up to
   ``max_batch``); a step with more rows, with a prefill, or with a layer callback runs eagerly.
2. **inputs**: rows 0..B-1 of the static buffers get each row's token, position, K row (where
   its new K/V go), padded block table and context length. Rows B..bucket-1 repeat row B-1:
   they compute exactly what row B-1 computes and write the same K/V bytes into the same slot,
   so padding needs no spare block and cannot touch another request's KV; their logits are
   dropped.
3. **replay**: the graph of that bucket (or, where graphs cannot be had, the same body run
   eagerly: on CPU, and in the CPU tests of this module) leaves logits ``[bucket, vocab]`` in
   a fixed output buffer; rows 0..B-1 go to the sampler.

Everything the body computes from the inputs is on the device and shaped by the bucket and
the table width alone (``max_blocks``, from the model length), never by the step's longest
context: that is what lets one capture serve every later step. The attention kernel must
take that fixed width (``gpu_attention.paged_decode`` sizes its splits from it).

Capture happens once at start-up (``capture()``, largest bucket first so smaller graphs reuse
its memory pool); ``--enforce-eager`` (EngineConfig.cuda_graphs=False) turns graphs off.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .kv_cache import KVCache
from .model import DecoderModel, ForwardBatch
from .attention_backends import backend

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """The buckets a server with ``max_batch`` running sequences captures (max_batch itself last)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out = [b for b in BUCKETS if b < max_batch]
    return (*out, max_batch) if max_batch <= BUCKETS[-1] else (*out, BUCKETS[-1])


@dataclass
class DecodeRow:
    """One decode row's inputs: its last token, that token's position, the K row its K/V go to,
    its block table and its context length (position + 1)."""

    token: int
    position: int
    slot_row: int
    block_table: list[int]


class DecodeGraphs:
    """Static buffers for up to ``buckets[-1]`` rows and one graph (or eager body) per bucket."""

    def __init__(self, model: DecoderModel, kv: KVCache, max_batch: int, max_blocks: int, attention: str = "torch"):
        self.model, self.kv, self.attention = model, kv, attention
        self.buckets = buckets_up_to(max_batch)
        self.max_blocks = max_blocks
        n, dev = self.buckets[-1], kv.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_rows = torch.zeros(n, dtype=torch.long, device=dev)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.long, device=dev)
        self.ends = torch.ones(n, dtype=torch.long, device=dev)
        self.rows = torch.arange(n, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @staticmethod
    def possible(device: torch.device) -> bool:
        """Whether a model on ``device`` can run decode steps from graphs (CUDA); asked once, at the engine's start."""
        return device.type == "cuda"

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket that holds ``batch`` rows; None when none does (the step runs eagerly)."""
        return next((b for b in self.buckets if b >= batch), None)

    def fits(self, rows: list[DecodeRow]) -> bool:
        return 0 < len(rows) <= self.max_batch and all(len(r.block_table) <= self.max_blocks for r in rows)

    # ---- one step ---------------------------------------------------------------------
    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` (float32) of one decode step over ``rows`` (``fits(rows)``
        must hold). The result is a view of the graph's output: read it before the next step."""
        bucket = self.bucket_for(len(rows))
        if bucket is None:
            raise ValueError(f"{len(rows)} rows: more than the largest captured batch ({self.max_batch}); "
                             "run() needs fits(rows)")
        self._load(rows, bucket)
        if bucket in self._graphs:
            graph, logits = self._graphs[bucket]
            graph.replay()
        else:
            logits = self._body(bucket)
        return logits[: len(rows)]

    def _load(self, rows: list[DecodeRow], bucket: int) -> None:
        """Copy the step's inputs into the static buffers (one host->device copy per buffer)."""
        padded = rows + [rows[-1]] * (bucket - len(rows))
        width = self.max_blocks
        host = {
            "input_ids": [r.token for r in padded],
            "positions": [r.position for r in padded],
            "slot_rows": [r.slot_row for r in padded],
            "ends": [r.position + 1 for r in padded],
        }
        for name, values in host.items():
            getattr(self, name)[:bucket].copy_(torch.tensor(values), non_blocking=True)
        table = torch.zeros(bucket, width, dtype=torch.long)
        for i, r in enumerate(padded):
            table[i, : len(r.block_table)] = torch.tensor(r.block_table)
        self.tables[:bucket].copy_(table, non_blocking=True)

    def _body(self, n: int) -> torch.Tensor:
        """The forward a graph captures: fixed shapes from ``n`` and ``max_blocks``, device ops only."""
        kv = self.kv
        tables, ends = self.tables[:n], self.ends[:n]
        decode_rows = decode_mask = None
        if not backend(self.attention).reads_tables:  # attention.py's gather over the table width (CPU, tests)
            width = self.max_blocks * kv.block_size
            decode_rows = kv.table_rows(tables)
            decode_mask = (torch.arange(width, device=ends.device) < ends.unsqueeze(1)).view(n, 1, 1, width)
        batch = ForwardBatch(input_ids=self.input_ids[:n], positions=self.positions[:n], slot_rows=self.slot_rows[:n],
                             prefills=[], decode_start=0, decode_rows=decode_rows, decode_mask=decode_mask,
                             logits_rows=self.rows[:n], decode_tables=tables, decode_ends=ends,
                             attention=self.attention)
        return self.model(batch, kv)

    def close(self) -> None:
        """Drop the graphs (their memory pool goes back to the caching allocator): eager from here on."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()

    # ---- start-up ---------------------------------------------------------------------
    def capture(self) -> float:
        """Capture one graph per bucket (CUDA only), largest first; returns the seconds it took.
        Each body runs once eagerly first (kernel autotuning and lazy initialisation happen
        outside the capture). The rows hold zeros meanwhile: block 0's slot 0 is written and
        read, which is harmless before any request runs (call this before serving)."""
        if not self.possible(self.kv.device):
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        t0 = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream(self.kv.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            for n in reversed(self.buckets):
                self._body(n)  # warm-up, outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._body(n)
                pool = graph.pool()
                self._graphs[n] = (graph, logits)
        torch.cuda.current_stream(self.kv.device).wait_stream(stream)
        torch.cuda.synchronize(self.kv.device)
        seconds = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (batch %s, block tables up to %d blocks) in %.1fs",
                 len(self._graphs), ",".join(map(str, self.buckets)), self.max_blocks, seconds)
        return seconds
