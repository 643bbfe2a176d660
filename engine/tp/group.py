"""TPGroup: one rank's end of the tensor-parallel process group (torch.distributed, no global state).

Made from a TCPStore that rank 0 opens on a free localhost port (``ranks.py``); every rank builds
the same groups from it, so nothing depends on ``torch.distributed``'s default group and one
process may hold several engines. Two groups, both gloo on CPU (the compute one NCCL on CUDA):

- ``steps``: rank 0 broadcasts each step's header (the length of what follows, or ``STOP``). A
  worker waits there between steps for as long as rank 0 is idle, so its timeout is a year; rank
  0's death closes the sockets and the worker's wait fails at once.
- ``compute``: the step's payload (its inputs, pickled, broadcast as bytes: gloo, CPU), then the
  model's collectives: the all-reduce of every row-parallel projection (o_proj, down_proj) and the
  gather of the vocabulary-parallel LM head's logits. Its timeout (``timeout_s``) bounds how long
  rank 0 waits on a rank that hangs; one that dies fails the collective at once.

On the CPU the collectives small enough (a decode step's) go through shared memory instead of gloo when
``use_shm`` gave them a segment (``shm_collectives.py``: rank 0 makes it, ``ranks.py``/``worker.py`` open it).

``attach(model)`` hooks those collectives on the model's projections (``combine``, which
``layer_ops.TorchOps.linear`` applies to a projection's output): the family's layer code is unchanged.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .shm_collectives import ShmCollectives

if TYPE_CHECKING:
    from ..model import DecoderModel

STOP = -1  # a steps header: the worker returns
IDLE_TIMEOUT = timedelta(days=365)  # a worker waiting for rank 0's next step


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float):
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        timeout = timedelta(seconds=timeout_s)
        # (Any: torch's stubs do not declare the backends' collectives)
        self.steps: Any = dist.ProcessGroupGloo(dist.PrefixStore("steps", store), rank, size, IDLE_TIMEOUT)
        self.payload: Any = dist.ProcessGroupGloo(dist.PrefixStore("payload", store), rank, size, timeout)
        self.compute: Any = self.payload
        if device.type == "cuda":  # the model's tensors stay on the GPU: NCCL for them, gloo for the bytes
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, size, options)
        self.shm: ShmCollectives | None = None  # CPU ranks: the small collectives through shared memory

    def use_shm(self, shm: ShmCollectives) -> None:
        """From now on, collectives that fit a slot go through ``shm`` (every rank switches before the barrier)."""
        self.shm = shm

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    # ---- the step's inputs (rank 0 sends, the others receive) ----------------------------------
    def send(self, message: object) -> None:
        """Rank 0: ``message`` (pickled; its tensors on the CPU) to every other rank."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.steps.broadcast(torch.tensor([len(data)]), 0).wait()
        self.payload.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0).wait()

    def send_stop(self) -> None:
        self.steps.broadcast(torch.tensor([STOP]), 0).wait()

    def receive(self) -> Any:
        """A worker: the next message from rank 0, or None when rank 0 stops the group."""
        header = torch.empty(1, dtype=torch.long)
        self.steps.broadcast(header, 0).wait()
        if int(header) == STOP:
            return None
        data = torch.empty(int(header), dtype=torch.uint8)
        self.payload.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())

    def sync(self) -> None:
        """Every rank has got here (the per-rank push's "every rank wrote this layer": ``rank_pools.py``): a
        one-element all-reduce, through shared memory when there is a segment, else gloo (with the timeout)."""
        flag = torch.zeros(1)
        if self.shm is not None:
            self.shm.all_reduce(flag)
        else:
            self.payload.allreduce([flag]).wait()

    def barrier(self) -> None:
        """Every rank here (``steps``: no timeout but a rank's death, e.g. while the others load)."""
        self.steps.allreduce([torch.zeros(1)]).wait()

    # ---- the model's collectives -----------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``t`` (in place): a row-parallel projection's output."""
        if self.shm is not None and self.shm.fits(t):
            return self.shm.all_reduce(t)
        self.compute.allreduce([t]).wait()
        return t

    def gather_vocab(self, vocab_size: int):
        """``combine`` for the LM head: each rank's logits ``[rows, V/N]`` -> every rank's ``[rows, V]``."""
        def gather(t: torch.Tensor) -> torch.Tensor:
            t = t.contiguous()
            if self.shm is not None and self.shm.fits(t):
                return self.shm.all_gather_last(t)[..., :vocab_size]
            parts = [torch.empty_like(t) for _ in range(self.size)]
            self.compute.allgather([parts], [t]).wait()
            return torch.cat(parts, dim=-1)[..., :vocab_size]

        return gather

    def gather(self, t: torch.Tensor, small: bool = False) -> list[torch.Tensor]:
        """Every rank's ``t`` (one shape on all ranks) at rank 0, in rank order; [] on the other ranks.
        ``small``: a CPU tensor (a checksum), over the payload group (gloo) whatever the device."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else []
        (self.payload if small else self.compute).gather(parts, t, 0).wait()
        return parts

    def scatter(self, parts: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Rank 0 gives ``parts[r]`` to rank ``r`` (``parts``: one per rank, one shape); the others pass ``out``
        (that shape) to receive into. Returns this rank's part."""
        if self.rank == 0:
            parts = [p.contiguous() for p in parts]
            out = torch.empty_like(parts[0])
        assert out is not None
        self.compute.scatter(out, parts if self.rank == 0 else [], 0).wait()
        return out

    def attach(self, model: DecoderModel) -> None:
        """Hook the collectives on ``model``'s row-parallel projections and its LM head (a DecoderModel)."""
        for layer in model.layers:
            for name in ("o_proj", "down_proj"):
                if hasattr(layer, name):
                    setattr(getattr(layer, name), "combine", self.all_reduce)
            if getattr(layer, "sparse", False):  # a MoE layer: its experts' summed output (models/qwen3_moe.py)
                setattr(layer, "combine", self.all_reduce)
        setattr(model.lm_head, "combine", self.gather_vocab(model.cfg.vocab_size))
