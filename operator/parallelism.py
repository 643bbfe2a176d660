"""Pure builders: a pool's ``parallelism`` (schema and admission: ``crd_parallel.py``) -> its server flags
and what its pods need for tensor parallelism. Nothing changes at size 1, so a pool without the field
renders as before.

- ``args(spec, gpu)``: ``--tensor-parallel-size N`` at N > 1; on a CPU pool with a cpu limit (else request)
  also ``--threads cpu // N``: torch sizes its thread pool by the node's cores, not the container's CPU
  quota, so N ranks would each start a thread per node core and fight over the quota; cpu // N threads
  each (admission guarantees cpu >= N) fill the pod's CPUs once. ``engine.extraArgs`` come after, so a
  ``--threads`` there wins.
- ``apply(template, spec, gpu)``: a GPU pool at N > 1 gets

  - ``/dev/shm`` (``crd_pod.SHM_VOLUME``): a memory-backed emptyDir of ``SHM_PER_RANK`` x N unless the
    pool's ``shmSize`` says otherwise. NCCL keeps its inter-process buffers in shared-memory segments
    under /dev/shm, the only path between GPUs without peer-to-peer access, and fails to initialise when
    a container's 64 MiB runs out; NCCL's troubleshooting guide asks containers for 1 GiB
    (``--shm-size=1g``) and a pod here holds N ranks. The limit is a cap, not a reservation: the
    pages written count against the pod's memory;
  - ``NCCL_DEBUG=WARN`` (unless the pool's ``env`` sets NCCL_DEBUG): without it NCCL returns a bare
    "unhandled system error"; with it NCCL prints the cause first (a full /dev/shm, a GPU it cannot
    reach), which the pod log, and so the termination message the operator quotes
    (``pod_problems.py``), then carries. RCCL (ROCm, amd.com/gpu) reads the same variable.

  Nothing else: every rank is a process of the one container, so they share its IPC namespace (CUDA
  IPC between them needs no hostIPC), and their rendezvous is on localhost (no NCCL_SOCKET_IFNAME);
  no locked memory beyond the driver's own pinning is used between GPUs of one node (IPC_LOCK stays a
  pod setting, for RDMA). A CPU pool's ranks need no NCCL, and their shared-memory segment
  (``engine/tp/shm_collectives.py``: 2 MiB per rank) fits the container's own 64 MiB /dev/shm.
"""

from __future__ import annotations

from decimal import Decimal

from pdserve.operator import crd_parallel, crd_pod

SHM_PER_RANK_GIB = 1
NCCL_ENV = {"NCCL_DEBUG": "WARN"}


def tensor_size(spec: dict) -> int:
    return int((spec.get("parallelism") or {}).get("tensor", 1))


def cpu_cores(value: int | float | str) -> Decimal:
    """A Kubernetes CPU quantity (2, "500m", "1.5") in cores."""
    text = str(value).strip()
    return Decimal(text[:-1]) / 1000 if text.endswith("m") else Decimal(text)


def _cpu(spec: dict) -> Decimal | None:
    resources = spec.get("resources") or {}
    for part in ("limits", "requests"):
        value = (resources.get(part) or {}).get("cpu")
        if value is not None:
            return cpu_cores(value)
    return None


def args(spec: dict, gpu: bool) -> list[str]:
    """The pool's parallelism flags (none at tensor-parallel size 1); ``gpu``: whether it is a GPU pool
    (``pod_settings.uses_gpu``, which calls this)."""
    n = tensor_size(spec)
    if n == 1:
        return []
    flags = [crd_parallel.FLAG, str(n)]
    cpu = _cpu(spec)
    if not gpu and cpu is not None:
        flags += ["--threads", str(max(1, int(cpu // n)))]
    return flags


def apply(template: dict, spec: dict, gpu: bool) -> None:
    """Add what a GPU pool's pods need at tensor-parallel size > 1 (``pod_settings.apply`` calls it last)."""
    n = tensor_size(spec)
    if n == 1 or not gpu:
        return
    pod = template["spec"]
    container = pod["containers"][0]
    if spec.get("shmSize") is None:  # else pod_settings.apply mounted the pool's own size
        pod.setdefault("volumes", []).append(
            {"name": crd_pod.SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_PER_RANK_GIB * n}Gi"}})
        container.setdefault("volumeMounts", []).append({"name": crd_pod.SHM_VOLUME, "mountPath": crd_pod.SHM_PATH})
    named = {e["name"] for e in container.get("env", [])}
    container["env"] = [*container.get("env", []),
                        *({"name": k, "value": v} for k, v in NCCL_ENV.items() if k not in named)]
