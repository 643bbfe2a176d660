"""Rank 0's side of tensor parallelism: it starts the other ranks, sends them every step, stops them.

``TensorParallelSteps.start(loaded, kv_cache, switches, timeout_s)`` (called by LLMEngine when
``EngineConfig.tensor_parallel_size`` > 1):

1. opens a TCPStore on a free localhost port and starts ranks 1..N-1, each a
   ``python -m pdserve.engine.tp.worker`` process (``worker.py``) told the model's source, its rank, the
   KV pool's size and the engine switches; torch's thread count is rank 0's;
2. joins the process group with them (``group.py``) and hooks its collectives on rank 0's model; on the
   CPU (``shm``) it makes the shared-memory segment of the small collectives first (``shm_collectives.py``),
   which every rank maps before the barrier and rank 0 then unlinks;
3. waits until every rank has loaded its shard and made its KV cache (a rank that cannot: a
   TensorParallelError with its one-line reason).

``run(batch, extra_rows, on_layer, on_rows)`` is the runner's forward (``model_runner.py``: the same
call as ``LocalSteps``): the step's ForwardBatch and prompt-logprob rows go to every rank (pickled,
``group.send``), then rank 0 runs the model's forward as they do, and gets the whole vocabulary's
logits. A failure part-way (a rank dead or hung, or any error here once the ranks have the step) leaves
the ranks out of step: the engine is then lost for good, ``run`` raises TensorParallelError (naming the
rank that exited, with its exit code) now and on every later call, and the workers are stopped.

``close()`` (LLMEngine.close, or at exit) stops the workers: a STOP header, then a kill for any rank
still running after ``STOP_GRACE_S``. Workers also end by themselves when rank 0 dies (their wait for
the next step fails when its sockets close).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import weakref
from dataclasses import asdict, fields, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ShardChecksumError, TensorParallelError
from ..model import ForwardBatch
from . import shm_collectives
from .group import TPGroup
from .heads import kv_head_ranges
from .rank_pools import RankPool, close_pools, map_pools
from .shm_collectives import ShmCollectives
from .transfer import KVTransferPool

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # the ranks' rendezvous: their Python and torch start, on a loaded box
STOP_GRACE_S = 10.0  # a rank told to stop that has not exited by then is killed
STEP, INSTALL = "step", "install"  # what rank 0 sends: a step (its batch), or blocks arrived (transfer.py)
EXIT_GRACE_S = 5.0  # after a failed collective: how long to wait for a rank's exit status, to name it


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU for every rank, or the GPU ``rank`` places after rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_devices(device: torch.device, size: int) -> None:
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"tensor-parallel size {size} needs {size} GPUs from {device}; this process sees "
                         f"{torch.cuda.device_count()}")


class TensorParallelSteps:
    def __init__(self, model, kv_cache, group: TPGroup, procs: list[subprocess.Popen]):
        self.model, self.kv, self.group, self.procs = model, kv_cache, group, procs
        self.transfer: KVTransferPool | None = None  # rank 0's whole-heads pool, when KV moves (transfer.py)
        self.checksum = False  # each rank's shard summed across rank 0's hop (transfer.py; EngineConfig.kv_checksum)
        self.lost: TensorParallelError | None = None
        self.rank_pools: list[RankPool] = []  # every rank's pool, mapped here (per-rank push: rank_pools.py)
        self.pushes = {"gather": 0, "per_rank": 0}  # pushing steps by how their KV left the ranks
        self._finalizer = weakref.finalize(self, _stop, group, procs)

    @classmethod
    def start(cls, loaded, kv_cache, switches: dict, timeout_s: float, shm: bool = True,
              shared_pools: bool = False) -> "TensorParallelSteps":
        """``shared_pools`` (CPU): every worker's pool in a memfd that rank 0 maps (``rank_pools``), for the
        per-rank push; the pools are then ``rank_pools``, in rank order."""
        size, device = loaded.tensor_parallel_size, loaded.device
        shared_pools = shared_pools and device.type == "cpu"
        if loaded.source is None:
            raise ValueError("tensor parallelism needs a model from load_model (the other ranks load their "
                             "shards from the same source)")
        check_devices(device, size)
        store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        spec = {"port": store.port, "size": size, "timeout_s": timeout_s, "threads": torch.get_num_threads(),
                "model": {**asdict(loaded.source), "dtype": str(loaded.source.dtype).removeprefix("torch.")},
                "kv": {"num_blocks": kv_cache.num_blocks, "block_size": kv_cache.block_size,
                       "kv_dtype": kv_cache.kv_dtype, "shared": shared_pools}, "switches": switches}
        segment = shm_collectives.create_segment(size) if shm and shm_collectives.usable(device) else ""
        store.set("shm", segment)  # the workers open it before the barrier ("": gloo for every collective)
        procs = [subprocess.Popen([sys.executable, "-m", "pdserve.engine.tp.worker",
                                   json.dumps({**spec, "rank": r})]) for r in range(1, size)]
        try:
            group = TPGroup(store, 0, size, device, timeout_s)
            if segment:
                group.use_shm(ShmCollectives(segment, 0, size, timeout_s, lambda: _exited_now(procs)))
            group.attach(loaded.model)
            group.barrier()  # every rank loaded its shard (and mapped the segment, and named its pool)
            pools = map_pools(store, kv_cache, kv_head_ranges(loaded.config.num_kv_heads, size)) if shared_pools \
                else []
        except RuntimeError as exc:
            _kill(procs)
            raise TensorParallelError(_start_failure(store, procs, exc)) from None
        finally:
            if segment:  # mapped by every rank (or not needed): nothing left in /dev/shm
                shm_collectives.unlink_segment(segment, size)
        log.info("tensor parallelism: %d ranks (worker pids %s), %s", size, [p.pid for p in procs],
                 "NCCL" if device.type == "cuda" else "gloo" + (" and shared memory" if segment else ""))
        steps = cls(loaded.model, kv_cache, group, procs)
        steps.rank_pools = pools
        return steps

    def run(self, batch: ForwardBatch, extra_rows, on_layer, on_rows) -> torch.Tensor:
        blocks = self._push_blocks(on_layer)
        sync = bool(getattr(on_layer, "direct", False))  # some request's KV leaves from every rank's pool

        def step() -> torch.Tensor:
            self.group.send((STEP, on_cpu(batch), [rows.cpu() for rows in extra_rows], blocks, self.checksum, sync))
            hook = on_layer
            if blocks is not None:  # the gather is a collective: every rank wrote the layer once it is done
                hook = self._gathering(on_layer, blocks)
            elif sync:
                hook = self._synced(on_layer)
            return self.model(batch, self.kv, hook, extra_rows, on_rows)

        return self._in_step(step)

    def install(self, blocks: list[int]) -> None:
        """The decode's arrival (``transfer.py``): ``blocks`` of the transfer pool into every rank's pool."""
        transfer = self.transfer
        if transfer is None:
            raise ValueError("this tensor-parallel engine has no KV transfer pool (EngineConfig.kv_transfer)")
        if not blocks:
            return

        def scatter() -> None:
            sums = transfer.sums(list(blocks)) if self.checksum else None
            self.group.send((INSTALL, list(blocks), sums))
            transfer.install(self.group, list(blocks), sums)

        self._in_step(scatter)

    def _in_step(self, work):
        """``work()`` with every rank: any failure leaves the ranks out of step, so the engine is lost."""
        if self.lost is not None:
            raise self.lost
        try:
            return work()
        except ShardChecksumError:  # found after every rank's part of the collectives: still in step
            raise
        except Exception as exc:  # the ranks are out of step whatever failed: the engine is lost
            self.lost = TensorParallelError(self._why(exc))
            self.close()
            raise self.lost from None

    def _push_blocks(self, on_layer) -> list[int] | None:
        """The block ids a step's layer callback pushes through rank 0 (``remote_prefill.LayerCallback.blocks``:
        not those of per-rank pushes), or None."""
        blocks = getattr(on_layer, "blocks", None)
        if not blocks:
            return None
        if self.transfer is None:
            raise ValueError("this tensor-parallel engine has no KV transfer pool (EngineConfig.kv_transfer): its "
                             "KV cannot be pushed")
        return list(blocks)

    def _synced(self, on_layer):
        """The step's layer callback once every rank has written the layer (the per-rank push: rank 0's senders
        read each rank's pool from then on)."""
        self.pushes["per_rank"] += 1

        def hook(layer: int) -> None:
            self.group.sync()
            on_layer(layer)

        return hook

    def _gathering(self, on_layer, blocks: list[int]):
        """The step's layer callback after each layer's heads of ``blocks`` are gathered into the transfer pool."""
        transfer, idx = self.transfer, torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        assert transfer is not None
        self.pushes["gather"] += 1
        if getattr(on_layer, "direct", False):
            self.pushes["per_rank"] += 1

        def hook(layer: int) -> None:
            bad = transfer.gathered(self.group, layer, idx, self.checksum)
            if bad:  # never stored: the step's pushing requests fail after the step, the ranks go on in step
                on_layer.fail(ShardChecksumError(
                    f"kv_checksum_mismatch: tensor-parallel rank(s) {bad}'s shard of layer {layer}, KV blocks "
                    f"{blocks[0]}..{blocks[-1]}, did not land intact in rank 0's transfer pool"))
            on_layer(layer)

        return hook

    def _why(self, exc: BaseException) -> str:
        """One line: the rank that exited and its exit code, else a timeout, else what failed here."""
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        peer_failed = any(word in text.lower() for word in ("closed", "timed out", "timeout", "connection"))
        exited = self._exited(EXIT_GRACE_S if peer_failed else 0.0)
        if exited is not None:
            rank, proc = exited
            return (f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}: the engine "
                    "cannot step without it")
        if peer_failed:
            return f"a tensor-parallel rank did not answer within {self.group.timeout_s:g}s (hung?): {text}"
        return f"a tensor-parallel step failed part-way on rank 0, leaving the ranks out of step: {text}"

    def _exited(self, grace_s: float) -> tuple[int, subprocess.Popen] | None:
        """(rank, process) of the first worker that has exited, waiting up to ``grace_s`` for one."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    return rank, proc
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """Stop the other ranks (idempotent); close the mapped pools' fds (the mappings live while tensors use them)."""
        self._finalizer()
        close_pools(self.rank_pools)


def on_cpu(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` with every tensor on the CPU (what is pickled to the other ranks)."""
    return moved(batch, torch.device("cpu"))


def moved(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """``batch`` with every tensor on ``device`` (itself when they are there already)."""
    if batch.input_ids.device == device:
        return batch

    def to(v):
        return v.to(device) if isinstance(v, torch.Tensor) else v

    spans = [replace(span, context_rows=to(span.context_rows)) for span in batch.prefills]
    tensors = {f.name: to(getattr(batch, f.name)) for f in fields(batch) if f.name != "prefills"}
    return replace(batch, prefills=spans, **tensors)


def _start_failure(store: dist.TCPStore, procs: list[subprocess.Popen], exc: BaseException) -> str:
    """One line on why the ranks did not start: a rank's own reason (it wrote it to the store), else the error."""
    for rank in range(1, len(procs) + 1):
        if store.check([f"error/{rank}"]):
            return f"tensor-parallel rank {rank} could not start: {store.get(f'error/{rank}').decode()}"
    return f"the tensor-parallel ranks did not start: {str(exc).splitlines()[0]}"


def _exited_now(procs: list[subprocess.Popen]) -> str | None:
    """A worker that has exited, in words (the shared-memory collectives' ``lost``), or None."""
    for rank, proc in enumerate(procs, start=1):
        if proc.poll() is not None:
            return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
    return None


def _stop(group: TPGroup, procs: list[subprocess.Popen]) -> None:
    """STOP to every rank still running, then wait; kill what has not exited by STOP_GRACE_S."""
    if all(p.poll() is None for p in procs):
        try:
            group.send_stop()
        except RuntimeError:
            pass  # a rank is gone: the kill below ends the rest
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("tensor-parallel worker pid %d did not stop within %gs: killed", p.pid, STOP_GRACE_S)
    _kill(procs)
    group.close()


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
