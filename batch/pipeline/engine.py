"""PipelineEngine: the controller of N stage processes (TD-Pipe's "centralised engine").

::

    eng = PipelineEngine("tiny", PipelineConfig(num_stages=2, schedule="td-pipe"))
    eng.add_request("r1", prompt_ids, SamplingParams(max_tokens=64, temperature=0))
    outputs = eng.run()          # {request id: RequestOutput (all its tokens and text)}
    eng.close()                  # stops the stages, collects their timelines (eng.stage_traces)

The controller owns the requests, the one BlockManager whose block ids every stage uses, and
the output processing (stops, text) of the one-process engine. Its requests live in the
engine's one ``Scheduler`` (``pdserve.engine.scheduler``): waiting in the queue's order
(``priority``, then arrival: the SLO queue's order, as in the one-process engine), running
once admitted. It keeps up to ``num_stages`` micro-batches in flight; the schedule
(``schedules.py``: ``mixed`` or ``td-pipe``) says what the next micro-batch is whenever a slot
is free, and hears every micro-batch that returns. Which prompts enter a micro-batch, and how
many of their tokens, is the Scheduler's answer (``schedule_prompts``: one token budget,
chunked prefill, blocks), asked by both schedules.

Chunked prefill: a prompt longer than the budget (or ``long_prefill_threshold`` while a short
one waits) is sent as several spans. The stages run micro-batches in the order they were sent,
so a span's KV is written before any later micro-batch reads it: the next chunk may be sent
while the one before is still in flight (``num_computed`` moves on when a span is sent). Only
a prompt's last span samples a token.
The stages (``stage.py``) are separate processes started here (spawn), so the controller
never computes: its process mostly waits on the last stage's results.

Blocks grow on demand as sequences decode; when they run out, an idle sequence (newest first)
is preempted: its blocks are freed and it is recomputed later (``num_preemptions``).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.block_manager import BlockManager, blocks_needed
from pdserve.engine.errors import OutOfBlocksError
from pdserve.engine.outputs import OutputProcessor, take_output
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import RequestOutput, Sequence, SequenceFactory, Status
from . import protocol as P
from .config import SCHEDULES, PipelineConfig  # noqa: F401 - re-exported
from .meta import load_meta
from .stage import StageSpec, backend_for, layer_split, stage_main

@dataclass
class MicroBatch:
    mb_id: int
    seqs: list[Sequence]
    kind: int
    sent: float
    rows: int  # new tokens (prompt tokens of prefill spans + one per decode)
    samplers: list[Sequence] = field(default_factory=list)  # the rows that sample a token, in order
    times: list[float] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PipelineEngine:
    def __init__(self, model: str, config: PipelineConfig | None = None):
        from .schedules import make_schedule

        self.config = config = config or PipelineConfig()
        meta = load_meta(model)
        cfg = meta.config
        self.model_config, self.tokenizer = cfg, meta.tokenizer
        self.max_model_len = min(config.max_model_len or cfg.context_length, cfg.context_length)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_cache)
        # the one scheduler of every prompt (the one-process engine's): queue order, token budget, chunks, blocks
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_threshold)
        self.outputs = OutputProcessor(set(meta.tokenizer.eos_token_ids) | set(cfg.eos_token_ids), self.max_model_len)
        self.factory = SequenceFactory(cfg.vocab_size, self.max_model_len, meta.tokenizer.detokenizer,
                                       config.detokenize, self.scheduler.in_use)
        self.ready: list[Sequence] = []  # decode-ready, not in flight
        self.in_flight: deque[MicroBatch] = deque()
        self.results: dict[str, RequestOutput] = {}
        self.stage_traces: list[list[tuple[float, float, int, int]]] = []
        self.stage_cpu_s: list[float] = []  # CPU seconds each stage used (from close())
        self.batches: list[tuple[float, float, int, int, list[float]]] = []  # sent, returned, kind, seqs, times
        self.schedule = make_schedule(config.schedule, self)
        self._next_id = 0
        self._device = torch.device(config.device)
        splits = layer_split(cfg.num_layers, config.num_stages)
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = []
        for s, rng in enumerate(splits):
            spec = StageSpec(model, config.seed, config.dtype, self._stage_device(s), s, config.num_stages, rng,
                             config.num_blocks, config.block_size, config.threads_per_stage, init, config.timeout_s)
            p = ctx.Process(target=stage_main, args=(spec,), daemon=True, name=f"pdserve-stage-{s}")
            p.start()
            self.procs.append(p)
        try:
            dist.init_process_group(backend_for(config.device), init_method=init, rank=0,
                                    world_size=config.num_stages + 1, timeout=timedelta(seconds=config.timeout_s))
        except Exception:
            self._kill()
            raise
        self.link = P.Link(self._device)
        self._closed = False

    def _stage_device(self, stage: int) -> str:
        dev = torch.device(self.config.device)
        return f"cuda:{stage % max(torch.cuda.device_count(), 1)}" if dev.type == "cuda" else str(dev)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling, priority: float = 0.0) -> None:
        """Queue a request. ``priority``: its place in the queue (lower first, then arrival), as the one-process
        engine's Scheduler takes it: a caller holding an SLO queue (``pdserve.slo``: fifo, edf, qlm) passes
        each request's rank in that queue's order."""
        seq = self.factory.make(request_id, prompt_token_ids, sampling)
        need = blocks_needed(min(len(seq.prompt_ids) + sampling.max_tokens, self.max_model_len), self.config.block_size)
        if need > self.config.num_blocks:
            raise OutOfBlocksError(f"request {request_id!r} needs {need} KV blocks but the pool has only "
                                   f"{self.config.num_blocks}")
        seq.priority = priority
        self.scheduler.add(seq)

    @property
    def seqs(self) -> dict[str, Sequence]:
        """Every request not finished (waiting or running), by id."""
        return self.scheduler.seqs

    @property
    def waiting(self):
        """The waiting requests, in the order the Scheduler admits them."""
        return self.scheduler.waiting

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def running_seqs(self) -> list[Sequence]:
        return list(self.scheduler.running)

    def prompts(self, budget: int | None = None, admits=None) -> list[Sequence]:
        """The prompt spans of the next micro-batch: the Scheduler's ``schedule_prompts`` (chunks of prompts
        part-way, then waiting prompts admitted in the queue's order within ``budget`` tokens; None: the
        whole ``max_num_batched_tokens``), ``admits`` as there."""
        return self.scheduler.schedule_prompts(budget, admits)

    def set_schedule(self, name: str) -> None:
        """Switch schedules between runs (the stages, their weights and KV pool stay)."""
        from .schedules import make_schedule

        if self.seqs or self.in_flight:
            raise RuntimeError("set_schedule needs an idle engine (every request finished)")
        if name not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
        self.config.schedule = name
        self.schedule = make_schedule(name, self)

    # ---- blocks ----------------------------------------------------------------------------
    def grow(self, batch: list[Sequence]) -> list[Sequence]:
        """A slot for each decode sequence's next token, preempting idle sequences (newest
        first, then the batch's own newest) when blocks run out. Returns those that got one."""
        out = []
        for seq in list(batch):
            if seq.status is not Status.RUNNING:
                continue  # preempted for an earlier one
            while True:
                try:
                    self.block_manager.append_slots(seq.block_table, seq.num_tokens)
                    out.append(seq)
                    break
                except OutOfBlocksError:
                    idle = [s for s in self.ready if s not in batch] or [s for s in batch if s is not seq and
                                                                         s.status is Status.RUNNING]
                    if not idle:
                        if not self.in_flight:
                            raise
                        self.ready.append(seq)  # wait for in-flight work to free blocks
                        break
                    victim = max(idle, key=lambda s: s.arrival)
                    self.preempt(victim)
                    if victim in out:
                        out.remove(victim)
        return out

    def preempt(self, seq: Sequence) -> None:
        """An idle running sequence's blocks freed; it waits again, first, to be recomputed."""
        if seq in self.ready:
            self.ready.remove(seq)
        self.scheduler.preempt(seq)

    # ---- the loop --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.ready or self.in_flight or self.schedule.holds()
                    or any(s.num_tokens - s.num_computed > 1 for s in self.scheduler.running))  # a prompt part-way

    def run(self) -> dict[str, RequestOutput]:
        """Run every added request to the end; their outputs by request id."""
        done: dict[str, RequestOutput] = {}
        while self.has_work():
            done.update((o.request_id, o) for o in self.step())
        return done

    def step(self) -> list[RequestOutput]:
        """Fill the free micro-batch slots, wait for one micro-batch to come back; the outputs of
        the requests that finished with it (requests may be added between steps)."""
        while len(self.in_flight) < self.config.depth:
            seqs = self.schedule.next_batch()
            if not seqs:
                break
            self._send(seqs)
        if not self.in_flight:
            raise RuntimeError(f"the {self.config.schedule} schedule stalled with {len(self.waiting)} waiting "
                               f"and {len(self.ready)} ready requests and nothing in flight")
        return [self.results.pop(rid) for rid in self._receive()]

    def abort(self, request_id: str) -> bool:
        """Drop a request that has not started (still waiting): True if it was dropped. A running
        one finishes (its blocks return then); the caller ignores its output."""
        seq = self.seqs.get(request_id)
        if seq is None or seq not in self.waiting:
            return False
        self.scheduler.remove(request_id)
        self.results.pop(request_id, None)
        return True

    def _send(self, seqs: list[Sequence]) -> None:
        """One micro-batch to the first stage: prefill spans (each sequence's ``num_new`` tokens: a chunk; 0: all
        it has left), then decode rows. A span's ``num_computed`` moves to its end now (see the module doc)."""
        pre = [s for s in seqs if not _decode_ready(s)]
        dec = [s for s in seqs if _decode_ready(s)]
        kind = P.KIND_MIXED if pre and dec else (P.KIND_PREFILL if pre else P.KIND_DECODE)
        ordered = pre + dec
        meta = P.encode_rows([(s.num_computed, s.all_ids[s.num_computed:s.chunk_end], len(s.output_ids),
                               s.block_table, s.num_tokens) for s in ordered])
        samplers = [s for s in ordered if s.chunk_end >= s.num_tokens]  # a prompt's last span, or a decode row
        sampling = P.pack_sampling([s.sampling for s in samplers]) if samplers else None
        nbytes = 0 if sampling is None else sampling.numel()
        rows = sum(s.chunk_end - s.num_computed for s in ordered)
        mb = MicroBatch(self._next_id, ordered, kind, time.perf_counter(), rows, samplers)
        self._next_id += 1
        for s in ordered:
            s.num_computed, s.num_new = (s.chunk_end if s in pre else s.num_computed), 0
        body = P.pack([torch.tensor(meta, dtype=torch.int64)] + ([sampling] if sampling is not None else []))
        header = [P.CMD_RUN, mb.mb_id, kind, len(ordered), len(meta), rows, nbytes, body.numel()]
        self.link.send(1, [torch.tensor(header + [0] * self.config.num_stages), body])
        self.in_flight.append(mb)

    def _receive(self) -> list[str]:
        """The micro-batch that came back: its tokens appended; the ids of requests it finished."""
        n = self.config.num_stages
        header = self.link.recv_header(n, n)
        mb = self.in_flight.popleft()
        if header[1] != mb.mb_id:
            raise RuntimeError(f"micro-batch {header[1]} came back, expected {mb.mb_id}")
        tokens = self.link.recv(n, (len(mb.samplers),), torch.int64).tolist() if mb.samplers else []
        mb.times = [t / 1e9 for t in header[P.HEADER_LEN :]]
        self.batches.append((mb.sent, time.perf_counter(), mb.kind, len(mb.seqs), mb.times))
        for seq in mb.samplers:
            seq.num_computed = seq.num_tokens
        if self.config.enable_prefix_cache:  # up to num_computed (a later span in flight is computed before any reader)
            for seq in mb.seqs:
                self.scheduler.register_blocks(seq)
        finished = []
        for seq, token in zip(mb.samplers, tokens):
            self.outputs.append_token(seq, token)
            self._collect(seq)
            if seq.status is Status.FINISHED:
                finished.append(seq)
                self.scheduler.finish(seq)
        # the decode-ready ones (a prompt whose last span was this one, a decode row, or a prompt whose chunk
        # left only its last token: that one is computed as a decode row)
        alive = [s for s in mb.seqs if s.status is Status.RUNNING and _decode_ready(s)]
        self.schedule.returned(mb, alive, len(finished))
        return [s.request_id for s in finished]

    def _collect(self, seq: Sequence) -> None:
        out = take_output(seq)
        acc = self.results.get(seq.request_id)
        if acc is None:
            self.results[seq.request_id] = out
        else:
            acc.new_token_ids = acc.new_token_ids + out.new_token_ids
            acc.text += out.text
            acc.finished, acc.finish_reason = out.finished, out.finish_reason

    # ---- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the stages (collecting their timelines) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        try:
            self.link.send(1, [torch.tensor([P.CMD_STOP] + [0] * (P.HEADER_LEN - 1 + self.config.num_stages))])
            self.link.flush()
            for s in range(self.config.num_stages):
                box = [None]
                dist.recv_object_list(box, src=s + 1)
                trace, cpu_s = box[0]
                self.stage_traces.append(trace)
                self.stage_cpu_s.append(cpu_s)
        finally:
            dist.destroy_process_group()
            for p in self.procs:
                p.join(timeout=30)
            self._kill()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)

    def __enter__(self) -> "PipelineEngine":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self._closed = True
            try:
                dist.destroy_process_group()
            finally:
                self._kill()
        else:
            self.close()


def _decode_ready(seq: Sequence) -> bool:
    """One token left to compute and some computed: a decode row (else a prefill span)."""
    return seq.num_tokens - seq.num_computed == 1 and seq.num_computed > 0
