"""Pure builders: a pool's (or the router's) engine and pod settings -> server flags, pod template
additions and a PodDisruptionBudget. The schema of these settings is ``crd_pod.py``.

- ``engine_args(spec)``: the engine flags of a prefill or decode server: ``--device cuda`` and a
  GPU dtype on a GPU pool (``uses_gpu``), and what ``spec.engine`` says (dtype, KV cache size,
  batch and context limits, engine), ``parallelism`` (``parallelism.py``), then ``extraArgs`` verbatim;
- ``apply(template, spec, selector)``: adds the pod settings to a pod template the workload
  builders made (env, envFrom, volumes and mounts, /dev/shm, capabilities, scheduling, image
  pull secrets, pod labels and annotations under the operator's own), then what tensor parallelism
  needs (``parallelism.apply``);
- ``build_disruption_budget(...)``: the PodDisruptionBudget that goes with each Deployment.
"""

from __future__ import annotations

import copy
from decimal import Decimal, InvalidOperation

from pdserve.operator import crd_pod, parallelism

_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}


def quantity_bytes(value: int | str) -> int:
    """A Kubernetes quantity of bytes (4Gi, 512Mi, 1.5G, 4096) as an int, rounded up."""
    if isinstance(value, int):
        return value
    text = str(value).strip()
    suffix = next((s for s in sorted(_SUFFIXES, key=len, reverse=True) if s and text.endswith(s)), "")
    try:
        number = Decimal(text[:len(text) - len(suffix)])
    except InvalidOperation:
        raise ValueError(f"not a quantity of bytes: {value!r} (e.g. 4Gi, 512Mi)") from None
    total = number * _SUFFIXES[suffix]
    return int(total) + (total % 1 > 0)


def uses_gpu(spec: dict) -> bool:
    """Whether the pool's resources (limits or requests) name a GPU (``crd_pod.is_gpu_resource``: MIG slices too)."""
    resources = spec.get("resources") or {}
    return any(crd_pod.is_gpu_resource(key) for part in ("limits", "requests") for key in resources.get(part) or {})


def uses_nvidia_gpu(spec: dict) -> bool:
    """Whether the pool asks for an NVIDIA GPU (nvidia.com/gpu or a MIG slice): such pools run the operator's
    CUDA image (pools.default_image); an AMD pool names its own (ROCm) image, pdserve builds none."""
    resources = spec.get("resources") or {}
    return any(crd_pod.is_gpu_resource(key) and key.startswith(crd_pod.NVIDIA_PREFIX)
               for part in ("limits", "requests") for key in resources.get(part) or {})


def dtype(spec: dict) -> str:
    """The dtype the pool computes in: ``engine.dtype``, else the GPU's or the CPU's default."""
    explicit = (spec.get("engine") or {}).get("dtype")
    return explicit or (crd_pod.GPU_DTYPE if uses_gpu(spec) else crd_pod.CPU_DTYPE)


def engine_args(spec: dict) -> list[str]:
    """The engine flags of a prefill or decode server (after the operator's own, before nothing)."""
    engine = spec.get("engine") or {}
    args = []
    if engine.get("name"):
        args += ["--engine", engine["name"]]
    if engine.get("simProfile"):
        args += ["--sim-profile", engine["simProfile"]]
    if uses_gpu(spec):
        args += ["--device", crd_pod.GPU_DEVICE, "--dtype", dtype(spec)]
    elif engine.get("dtype"):  # else the server's CPU default, which is crd_pod.CPU_DTYPE
        args += ["--dtype", engine["dtype"]]
    if engine.get("quantization"):
        args += ["--quantization", engine["quantization"]]
    if engine.get("kvCacheDtype"):
        args += ["--kv-cache-dtype", engine["kvCacheDtype"]]
    if engine.get("kvCacheMemory") is not None:
        args += ["--kv-cache-memory", str(quantity_bytes(engine["kvCacheMemory"]))]
    if engine.get("gpuMemoryUtilization") is not None:
        args += ["--gpu-memory-utilization", f"{float(engine['gpuMemoryUtilization']):g}"]
    for field, flag in (("numBlocks", "--num-blocks"), ("maxNumSeqs", "--max-num-seqs"),
                        ("maxModelLen", "--max-model-len")):
        if engine.get(field) is not None:
            args += [flag, str(int(engine[field]))]
    return args + parallelism.args(spec, uses_gpu(spec)) + list(engine.get("extraArgs") or [])


def _spread(constraint: dict, selector: dict) -> dict:
    constraint = copy.deepcopy(constraint)
    constraint.setdefault("labelSelector", {"matchLabels": dict(selector)})
    return constraint


def apply(template: dict, spec: dict, selector: dict) -> None:
    """Add the pod settings of ``spec`` to a pod template (``{"metadata", "spec"}``, one container).

    The operator's labels and annotations win over ``podLabels`` / ``podAnnotations`` (the schema
    refuses keys that collide); ``selector`` is what a topology spread constraint without a
    labelSelector selects (the pool's pods).
    """
    pod, metadata = template["spec"], template["metadata"]
    container = pod["containers"][0]
    if spec.get("env"):
        container["env"] = [*container.get("env", []), *copy.deepcopy(spec["env"])]
    if spec.get("envFrom"):
        container["envFrom"] = copy.deepcopy(spec["envFrom"])
    volumes, mounts = pod.setdefault("volumes", []), container.setdefault("volumeMounts", [])
    if spec.get("shmSize") is not None:
        volumes.append({"name": crd_pod.SHM_VOLUME,
                        "emptyDir": {"medium": "Memory", "sizeLimit": str(spec["shmSize"])}})
        mounts.append({"name": crd_pod.SHM_VOLUME, "mountPath": crd_pod.SHM_PATH})
    volumes += copy.deepcopy(spec.get("extraVolumes") or [])
    mounts += copy.deepcopy(spec.get("extraVolumeMounts") or [])
    if spec.get("capabilities"):
        container["securityContext"]["capabilities"]["add"] = list(spec["capabilities"])
    for key in ("affinity", "runtimeClassName", "priorityClassName", "schedulerName"):
        if spec.get(key):
            pod[key] = copy.deepcopy(spec[key])
    if spec.get("topologySpreadConstraints"):
        pod["topologySpreadConstraints"] = [_spread(c, selector) for c in spec["topologySpreadConstraints"]]
    if spec.get("imagePullSecrets"):
        pod["imagePullSecrets"] = copy.deepcopy(spec["imagePullSecrets"])
    if spec.get("podLabels"):
        metadata["labels"] = {**spec["podLabels"], **metadata["labels"]}
    if spec.get("podAnnotations"):
        metadata["annotations"] = {**spec["podAnnotations"], **metadata.get("annotations", {})}
    parallelism.apply(template, spec, uses_gpu(spec))


DEFAULT_BUDGET = {"maxUnavailable": 1}


def build_disruption_budget(metadata: dict, selector: dict, spec: dict) -> dict:
    """The PodDisruptionBudget of a pool's (or the router's) pods: ``spec.disruptionBudget``, else
    maxUnavailable 1 (a drain takes one pod at a time; with one replica that pod may go, as
    without a budget). Pods that are not ready may always be evicted, so a crash-looping pod never
    blocks a drain."""
    budget = spec.get("disruptionBudget") or DEFAULT_BUDGET
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": copy.deepcopy(metadata),
        "spec": {**copy.deepcopy(budget), "selector": {"matchLabels": dict(selector)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }
