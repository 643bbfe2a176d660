"""One pipeline stage: a process holding layers [lo, hi) of the decoder and their paged KV.

The first stage also embeds the input ids; the last also holds the final norm, the LM head
and the sampler. Each stage loops: receive a micro-batch (see ``protocol.py``), rebuild its
ForwardBatch from the block tables (ModelRunner.build_batch, the one-process code), run its
layers, send the activations on (or the sampled tokens back to the controller). It records
(start, end, micro-batch id, kind) of every forward for the utilisation timeline, and sends
that trace (and the CPU seconds it used) to the controller when told to stop.

Backend: gloo on CPU; NCCL when the device is CUDA (every message then lives on the GPU;
written for, not tested here: this machine has no GPU).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import protocol as P


@dataclass(frozen=True)
class StageSpec:
    """Everything a stage process needs to start (picklable)."""

    model: str
    seed: int
    dtype: str
    device: str
    stage: int
    num_stages: int
    layers: tuple[int, int]
    num_blocks: int
    block_size: int
    threads: int
    init_method: str
    timeout_s: float


def layer_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal layer ranges, one per stage (earlier stages get the extra layers)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be between 1 and the model's {num_layers} layers, got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    out, lo = [], 0
    for s in range(num_stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _die_with_parent() -> None:
    """Linux: the kernel kills this stage when its controller dies (even by SIGKILL), so a
    killed batch server leaves no stage blocked in a receive until the timeout."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the stage ends at the process group's timeout


def stage_main(spec: StageSpec) -> None:
    """Entry point of a stage process (spawned by PipelineEngine)."""
    _die_with_parent()
    torch.set_num_threads(spec.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
    stage = Stage(spec)  # load first: the controller's rendezvous returns once every stage is ready
    dist.init_process_group(backend_for(spec.device), init_method=spec.init_method, rank=spec.stage + 1,
                            world_size=spec.num_stages + 1, timeout=timedelta(seconds=spec.timeout_s))
    try:
        stage.loop()
    finally:
        dist.destroy_process_group()


class Stage:
    def __init__(self, spec: StageSpec):
        from pdserve.engine.kv_cache import KVCache
        from pdserve.engine.loader import load_model
        from pdserve.engine.model_runner import ModelRunner
        from pdserve.engine.sampling import Sampler

        self.spec = spec
        self.device = torch.device(spec.device)
        loaded = load_model(spec.model, dtype=getattr(torch, spec.dtype), device=self.device, seed=spec.seed)
        model, cfg = loaded.model, loaded.config
        lo, hi = spec.layers
        for i in range(cfg.num_layers):  # keep only this stage's layers' weights
            if not lo <= i < hi:
                model.layers[i] = torch.nn.Identity()
        self.first, self.last = spec.stage == 0, spec.stage == spec.num_stages - 1
        self.model, self.cfg, self.dtype = model, cfg, loaded.dtype
        self.kv = KVCache(hi - lo, spec.num_blocks, spec.block_size, cfg.num_kv_heads, cfg.head_dim,
                          loaded.dtype, self.device)
        self.runner = ModelRunner(model, self.kv, Sampler(self.device, spec.seed), self.device)
        self.link = P.Link(self.device)
        self.prev = spec.stage  # rank of the previous hop (the controller for stage 0)
        self.next = 0 if self.last else spec.stage + 2
        self.trace: list[tuple[float, float, int, int]] = []

    def loop(self) -> None:
        n = self.spec.num_stages
        cpu0 = time.process_time()
        while True:
            header = self.link.recv_header(self.prev, n)
            cmd, mb_id, kind, num_seqs, meta_len, rows, sampling_bytes, payload_bytes = header[: P.HEADER_LEN]
            if cmd == P.CMD_STOP:
                if not self.last:
                    self.link.send(self.next, [torch.tensor(header)])
                self.link.flush()
                dist.send_object_list([(self.trace, time.process_time() - cpu0)], dst=0)
                return
            payload = self.link.recv(self.prev, (payload_bytes,), torch.uint8)
            specs = [((meta_len,), torch.int64)]
            if not self.first:
                specs.append(((rows, self.cfg.hidden_size), self.dtype))
            if sampling_bytes:
                specs.append(((sampling_bytes,), torch.uint8))
            parts = P.unpack(payload, specs)
            meta, hidden = parts[0], (None if self.first else parts[1])
            sampling = parts[-1] if sampling_bytes else None
            t0 = time.perf_counter()
            out = self.forward(meta.tolist(), num_seqs, hidden, sampling)
            t1 = time.perf_counter()
            header[P.HEADER_LEN + self.spec.stage] = int((t1 - t0) * 1e9)
            self.trace.append((t0, t1, mb_id, kind))
            if self.last:  # the sampled tokens (none when every row is a chunk before a prompt's last)
                header[P.HEADER_LEN - 1] = out.numel() * 8
                self.link.send(0, [torch.tensor(header)] + ([out] if out.numel() else []))
            else:
                body = P.pack([meta, out] + ([sampling] if sampling is not None else []))
                header[P.HEADER_LEN - 1] = body.numel()
                self.link.send(self.next, [torch.tensor(header), body])

    @torch.inference_mode()
    def forward(self, meta: list[int], num_seqs: int, hidden, sampling) -> torch.Tensor:
        rows = P.decode_rows(meta, num_seqs)
        pre = [r for r in rows if not r.is_decode]
        dec = [r for r in rows if r.is_decode]
        if rows != pre + dec:
            raise RuntimeError("micro-batch rows must be prefill spans first, then decode rows")
        batch = self.runner.build_batch(pre, dec)
        x = self.model.embed(batch.input_ids) if self.first else hidden.to(self.device)
        x = self.model.run_layers(x, batch, self.kv, range(*self.spec.layers))
        if not self.last:
            return x
        samplers = [r for r in rows if r.samples]  # the logits rows, in order (build_batch: a span's last chunk)
        if not samplers:
            return torch.empty(0, dtype=torch.int64)
        logits = self.model.head(x, batch)
        if sampling is None:
            tokens = logits.argmax(dim=-1)
        else:
            params = P.unpack_sampling(sampling)
            tokens = torch.tensor(self.runner.sampler.sample(logits, params, [r.n_generated for r in samplers]))
        return tokens.to(torch.int64)
