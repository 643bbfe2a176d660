"""The pools' engine and pod settings in the CRD schema (pure data), and the facts the builders
share with it.

- ``engine_schema(role)``: ``engine`` of a prefill or decode pool: how its server computes
  (engine, dtype, KV cache size, batch and context limits) and extra server flags;
- ``POD_SETTINGS``: what every pool and the router may add to their pods (env, envFrom,
  affinity, topology spread, runtime and priority class, pod annotations and labels, /dev/shm,
  extra volumes and mounts, capabilities); ``DISRUPTION_BUDGET``; ``IMAGE_PULL_SECRETS``;
- ``POOL_RULES``: the rules on one pool (a GPU-only setting needs a GPU), ``DTYPE_RULE`` and
  ``KV_DTYPE_RULE``: the InferenceService's pools compute in one dtype and keep KV in one KV dtype
  (KV moves between them as is).

A pool is a GPU pool when its resources (limits or requests) name one of ``GPU_RESOURCES`` or a
name under ``GPU_RESOURCE_PREFIXES`` (MIG slices):
its server gets ``--device cuda`` and ``GPU_DTYPE`` unless ``engine.dtype`` says otherwise;
any other pool computes on the CPU (``CPU_DTYPE``). The schema refuses a spec that sets what
is the operator's own (its server flags, environment variables, labels, annotations, volumes
and mount paths, listed here), with a message naming the field. ``pod_settings.py`` turns
these settings into pods; ``crds.py`` and ``crd_policy.py`` assemble the CRDs.
"""

from __future__ import annotations

from pdserve import defaults
# the servers' --dtype choices and defaults on each kind of device: one place (torch-free)
from pdserve.kv_sizing import CPU_DTYPE, DTYPES, GPU_DTYPE  # noqa: F401 - re-exported for the builders
from pdserve.operator import naming, tls_pods
from pdserve.operator.crd_schema import _int, _obj, _rule, _str

GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")  # the resource names that make a pool a GPU pool
# ... and every name under these prefixes: NVIDIA's MIG slices (nvidia.com/mig-3g.40gb, mig-1g.10gb, ...)
GPU_RESOURCE_PREFIXES = ("nvidia.com/mig-",)
GPU_NAMES = " or ".join([*GPU_RESOURCES, *(p + "*" for p in GPU_RESOURCE_PREFIXES)])  # for messages


NVIDIA_PREFIX = "nvidia.com/"  # the GPU resources (nvidia.com/gpu, MIG slices) whose pools run the CUDA image


def is_gpu_resource(name: str) -> bool:
    return name in GPU_RESOURCES or name.startswith(GPU_RESOURCE_PREFIXES)
GPU_DEVICE = "cuda"  # what --device says on a GPU pool (ROCm builds of torch call AMD GPUs cuda too)
ENGINES = ("builtin", "vllm", "sim")  # = pdserve.server_setup.ENGINES (checked by the same test)

# Linux capabilities a pool may add to its container (everything else stays dropped):
# IPC_LOCK lets a process pin memory beyond RLIMIT_MEMLOCK, which RDMA needs to register the KV
# cache with the NIC (NIXL/UCX over InfiniBand or RoCE, GPUDirect RDMA); SYS_RESOURCE lets it
# raise RLIMIT_MEMLOCK itself, as some RDMA libraries do at start. Nothing else: RDMA devices
# come from a device plugin (as resources), and NET_RAW / NET_ADMIN / SYS_ADMIN / SYS_PTRACE
# are needed by none of the transports and widen what a compromised server could do.
CAPABILITIES = ("IPC_LOCK", "SYS_RESOURCE")

# The flags the operator writes itself (workloads.py); engine.extraArgs must not repeat them.
ENGINE_FLAGS = ("--engine", "--device", "--dtype", "--quantization", "--kv-cache-dtype", "--kv-cache-memory",
                "--gpu-memory-utilization", "--num-blocks", "--max-num-seqs", "--max-model-len", "--sim-profile")
OPERATOR_FLAGS = {
    "prefill": ("--host", "--port", "--grpc-port", "--model", "--served-model-name", "--discovery", "--namespace",
                "--decode-selector", "--policy", "--transfer", "--block-size", "--drain-timeout", "--batch-db",
                "--api-key-file", *tls_pods.FLAGS, *ENGINE_FLAGS),
    "decode": ("--host", "--advertise-host", "--port", "--http-port", "--kv-port", "--model", "--served-model-name",
               "--transfer", "--block-size", "--drain-timeout", *tls_pods.FLAGS, *ENGINE_FLAGS),
}
# The environment, volumes, mount paths and pod annotations the operator sets (workloads.py).
OPERATOR_ENV = (defaults.ENV_INFERENCE_SERVICE, defaults.ENV_POOL, "POD_NAME", "POD_NAMESPACE", "POD_IP", "HOME",
                "PDSERVE_PROTOCOL_VERSION", defaults.ENV_SLO_CLASSES)
SHM_VOLUME, SHM_PATH = "dshm", "/dev/shm"
# model-cache: model_pods.CACHE_VOLUME; api-keys: workloads.API_KEYS_VOLUME (spec.auth); tls: tls_pods.VOLUME
OPERATOR_VOLUMES = ("tmp", "model", "model-cache", "batch", "api-keys", tls_pods.VOLUME, SHM_VOLUME)
OPERATOR_MOUNT_PATHS = ("/tmp", SHM_PATH, "/model-cache", defaults.API_KEYS_MOUNT, tls_pods.MOUNT)
OPERATOR_ANNOTATIONS = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path")
# Pod labels: every key of naming.common_labels, and anything under pdserve.io/.
OPERATOR_LABELS = tuple(naming.common_labels("x", "x", "x", "x"))
LABEL_PREFIX = naming.GROUP + "/"

MAX_BLOCKS = 100_000_000
MAX_MODEL_LEN = 100_000_000
MAX_NUM_SEQS = 65_536


def _cel_list(items) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def gpu_cel(pool: str) -> str:
    """CEL: whether the pool object ``pool`` names a GPU in its resources."""
    parts = []
    for part in ("limits", "requests"):
        named = " || ".join([*(f"k == '{key}'" for key in GPU_RESOURCES),
                             *(f"k.startsWith('{prefix}')" for prefix in GPU_RESOURCE_PREFIXES)])
        parts.append(f"(has({pool}.resources.{part}) && {pool}.resources.{part}.exists(k, {named}))")
    return f"(has({pool}.resources) && ({' || '.join(parts)}))"


def dtype_cel(pool: str) -> str:
    """CEL: the dtype the pool object ``pool`` computes in (what pod_settings.dtype says)."""
    return (f"((has({pool}.engine) && has({pool}.engine.dtype)) ? {pool}.engine.dtype : "
            f"({gpu_cel(pool)} ? '{GPU_DTYPE}' : '{CPU_DTYPE}'))")


_BYTES = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    "pattern": r"^([0-9]+(\.[0-9]+)?)([KMGTPE]i|[kMGTPE])?$",
    "minimum": 1,
}


def _flag_rule(role: str) -> dict:
    reserved = _cel_list(OPERATOR_FLAGS[role])
    taken = f"{reserved}.exists(f, a == f || a.startsWith(f + '='))"
    return {
        "rule": f"self.all(a, !{taken})",
        "message": f"engine.extraArgs must not repeat a flag the operator sets for {role} pods "
                   f"({', '.join(OPERATOR_FLAGS[role])}): use the engine fields",
        "messageExpression": f"'engine.extraArgs sets ' + self.filter(a, {taken})[0] + ', which the operator sets "
                             f"for {role} pods (use the engine fields, or leave it to the operator)'",
    }


def engine_schema(role: str) -> dict:
    """``engine`` of a prefill or decode pool: the server's engine flags."""
    return _obj(
        {
            "name": _str("builtin: pdserve's engine; vllm: vLLM's engine with pdserve's KV connector; sim: no "
                         "model, each step the time simProfile models (a pod of about 75 MiB, for control-plane "
                         "tests at scale) (`--engine`; default: the server's, builtin).", enum=list(ENGINES)),
            "simProfile": _str("name: sim: the profile, a shipped one by name (cpu-small, h200-llama3-8b) or a path "
                               "in the image (`--sim-profile`).", minLength=1, maxLength=1024),
            "dtype": _str(f"Weights and KV cache dtype (`--dtype`). Default: {GPU_DTYPE} on a GPU pool (resources "
                          f"name {GPU_NAMES}), {CPU_DTYPE} on the CPU. Prefill and decode "
                          "pools must compute in the same dtype.", enum=list(DTYPES), maxLength=16),
            "quantization": _str("fp8: the model's linear projections are quantized to FP8 at load (`--quantization`; "
                                 "half the weight bytes of bf16). Default: none; a checkpoint's own "
                                 "quantization_config is read either way (FP8 checkpoints load, other methods are "
                                 "refused at start).", enum=list(defaults.QUANTIZATIONS)),
            "kvCacheDtype": _str("auto: the KV cache in dtype; fp8: float8_e4m3fn with a scale per token per KV "
                                 "head, computed as each token is written, about twice the tokens in the same bytes "
                                 "(`--kv-cache-dtype`; the KV sizing counts the smaller blocks). Prefill and decode "
                                 "pools must use the same.", enum=list(defaults.KV_CACHE_DTYPES)),
            "kvCacheMemory": {**_BYTES, "description": "Bytes of the KV cache, a quantity such as 4Gi or 512Mi "
                                                      "(`--kv-cache-memory`)."},
            "gpuMemoryUtilization": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1,
                                     "description": "Fraction of the GPU's memory the server may use, weights and "
                                                    "KV cache together; the KV cache gets what the weights leave "
                                                    "(`--gpu-memory-utilization`; GPU pools only)."},
            "numBlocks": _int("KV cache blocks (`--num-blocks`): an exact count instead of a size.", 1, MAX_BLOCKS),
            "maxNumSeqs": _int("Most requests in one running batch (`--max-num-seqs`).", 1, MAX_NUM_SEQS),
            "maxModelLen": _int("Context length in tokens (`--max-model-len`; default: the model's).", 1,
                                MAX_MODEL_LEN),
            "extraArgs": {
                "type": "array",
                "description": "More flags appended to the server's command line, e.g. [--kv-checksum]. Flags "
                               "the operator sets are refused.",
                "maxItems": 64,
                "items": {"type": "string", "minLength": 1, "maxLength": 1024},
                "x-kubernetes-validations": [_flag_rule(role)],
            },
        },
        description="How the pool's servers compute (flags of `pdserve prefill` / `pdserve decode`).",
        **{"x-kubernetes-validations": [
            _rule("[has(self.kvCacheMemory), has(self.gpuMemoryUtilization), has(self.numBlocks)]"
                  ".filter(x, x).size() <= 1",
                  "engine: set at most one of kvCacheMemory, gpuMemoryUtilization and numBlocks (each sizes the "
                  "KV cache)"),
            _rule("has(self.name) && self.name == 'sim' ? has(self.simProfile) : !has(self.simProfile)",
                  "engine: simProfile goes with name: sim, and name: sim needs it"),
        ]},
    )


_NAME_REF = _obj({"name": _str("Its name.", minLength=1, maxLength=253),
                  "optional": {"type": "boolean", "description": "Start the pod even if it does not exist."}},
                 required=["name"])
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # RFC 1123 (volume names)
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# a core Kubernetes object, validated by the API server in the pod
_CORE = {"x-kubernetes-preserve-unknown-fields": True}

POD_SETTINGS = {
    "env": {
        "type": "array",
        "description": "More environment variables of the server container (as in a Pod: name, value or "
                       "valueFrom). The operator's own are refused.",
        "maxItems": 128,
        "items": _obj({"name": _str("Variable name.", minLength=1, maxLength=256),
                       "value": _str("Its value."),
                       "valueFrom": {"type": "object", "description": "A source for its value (as in a Pod).",
                                     **_CORE}},
                      required=["name"]),
        "x-kubernetes-validations": [
            _rule(f"self.all(e, !(e.name in {_cel_list(OPERATOR_ENV)}))",
                  f"env must not set the operator's variables ({', '.join(OPERATOR_ENV)})"),
        ],
    },
    "envFrom": {
        "type": "array",
        "description": "Secrets and ConfigMaps whose keys become environment variables (as in a Pod).",
        "maxItems": 32,
        "items": _obj({"prefix": _str("Prepended to each key.", maxLength=256),
                       "configMapRef": _NAME_REF, "secretRef": _NAME_REF},
                      **{"x-kubernetes-validations": [
                          _rule("has(self.configMapRef) != has(self.secretRef)",
                                "envFrom: each entry names exactly one of configMapRef and secretRef")]}),
    },
    "affinity": {"type": "object", "description": "Affinity of the pool's pods (as in a Pod).", **_CORE},
    "topologySpreadConstraints": {
        "type": "array",
        "description": "How the pool's pods spread over zones or nodes (as in a Pod); a constraint without "
                       "labelSelector selects the pool's own pods.",
        "maxItems": 8,
        "items": _obj({"maxSkew": _int("Largest difference of pod counts between domains.", 1, 1000),
                       "topologyKey": _str("Node label of the domain, e.g. topology.kubernetes.io/zone.",
                                           minLength=1, maxLength=316),
                       "whenUnsatisfiable": _str("DoNotSchedule or ScheduleAnyway.",
                                                 enum=["DoNotSchedule", "ScheduleAnyway"])},
                      required=["maxSkew", "topologyKey", "whenUnsatisfiable"], **_CORE),
    },
    "runtimeClassName": _str("RuntimeClass of the pool's pods (e.g. nvidia).", pattern=naming.DNS_SUBDOMAIN,
                             maxLength=253),
    "priorityClassName": _str("PriorityClass of the pool's pods.", pattern=naming.DNS_SUBDOMAIN, maxLength=253),
    "schedulerName": _str("The scheduler of the pool's pods (e.g. a Kueue or Volcano scheduler); default: the "
                          "cluster's.", pattern=naming.DNS_SUBDOMAIN, maxLength=253),
    "podAnnotations": {
        "type": "object",
        "description": "More annotations on the pool's pods; the operator's own (prometheus.io/*, pdserve.io/*) "
                       "are refused.",
        "additionalProperties": {"type": "string"},
        "maxProperties": 64,
        "x-kubernetes-validations": [
            _rule(f"self.all(k, !(k in {_cel_list(OPERATOR_ANNOTATIONS)}) && !k.startsWith('{LABEL_PREFIX}'))",
                  f"podAnnotations must not set the operator's annotations ({', '.join(OPERATOR_ANNOTATIONS)}, "
                  f"{LABEL_PREFIX}*)"),
        ],
    },
    "podLabels": {
        "type": "object",
        "description": "More labels on the pool's pods; the operator's own (pdserve.io/*, app.kubernetes.io/*) "
                       "are refused.",
        "additionalProperties": {"type": "string", "maxLength": 63, "pattern": _LABEL_VALUE},
        "maxProperties": 32,
        "x-kubernetes-validations": [
            _rule(f"self.all(k, !(k in {_cel_list(OPERATOR_LABELS)}) && !k.startsWith('{LABEL_PREFIX}'))",
                  f"podLabels must not set the operator's labels ({LABEL_PREFIX}*, "
                  f"{', '.join(k for k in OPERATOR_LABELS if not k.startswith(LABEL_PREFIX))})"),
        ],
    },
    "shmSize": {**_BYTES, "description": f"Size of {SHM_PATH}: a memory-backed emptyDir of this size limit (NCCL, "
                                         "CUDA IPC and vLLM's workers use shared memory; a container's own is 64Mi)."},
    "extraVolumes": {
        "type": "array",
        "description": "More volumes of the pool's pods (as in a Pod); mount them with extraVolumeMounts.",
        "maxItems": 32,
        "items": _obj({"name": _str("Volume name (a DNS label).", pattern=_DNS_LABEL, maxLength=63)},
                      required=["name"], **_CORE),
        "x-kubernetes-validations": [
            _rule(f"self.all(v, !(v.name in {_cel_list(OPERATOR_VOLUMES)}))",
                  f"extraVolumes must not use the operator's volume names ({', '.join(OPERATOR_VOLUMES)})"),
            _rule("self.all(v, self.exists_one(w, w.name == v.name))", "extraVolumes names must be unique"),
        ],
    },
    "extraVolumeMounts": {
        "type": "array",
        "description": "More mounts of the server container (as in a Container: name, mountPath, readOnly, ...).",
        "maxItems": 32,
        "items": _obj({"name": _str("The volume.", minLength=1, maxLength=63),
                       "mountPath": _str("Where it is mounted.", pattern="^/", maxLength=512)},
                      required=["name", "mountPath"], **_CORE),
        "x-kubernetes-validations": [
            _rule(f"self.all(m, !(m.mountPath in {_cel_list(OPERATOR_MOUNT_PATHS)}))",
                  f"extraVolumeMounts must not mount over the operator's paths ({', '.join(OPERATOR_MOUNT_PATHS)}); "
                  f"size {SHM_PATH} with shmSize"),
        ],
    },
    "capabilities": {
        "type": "array",
        "description": f"Linux capabilities added to the server container, one of {', '.join(CAPABILITIES)} "
                       "(all others stay dropped): IPC_LOCK to pin memory for RDMA. The pods run as a non-root "
                       "user without privilege escalation, so the server holds an added capability only where the "
                       "container runtime grants added capabilities to non-root users (ambient capabilities).",
        "maxItems": len(CAPABILITIES),
        "x-kubernetes-list-type": "set",
        "items": {"type": "string", "enum": list(CAPABILITIES)},
    },
}

DISRUPTION_BUDGET = _obj(
    {
        "maxUnavailable": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
                           "pattern": r"^[0-9]+%$", "minimum": 0,
                           "description": "Most pods of the pool a voluntary disruption (a node drain) may take at "
                                          "once: a count or a percentage."},
        "minAvailable": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
                         "pattern": r"^[0-9]+%$", "minimum": 0,
                         "description": "Fewest pods of the pool that must stay through a voluntary disruption: a "
                                        "count or a percentage."},
    },
    description="The pool's PodDisruptionBudget: at most one of maxUnavailable and minAvailable (default: "
                "maxUnavailable 1, so a drain takes one pod at a time). Pods that are not ready may always be "
                "evicted.",
    **{"x-kubernetes-validations": [
        _rule("!(has(self.maxUnavailable) && has(self.minAvailable))",
              "disruptionBudget: set maxUnavailable or minAvailable, not both"),
    ]},
)

IMAGE_PULL_SECRETS = {
    "type": "array",
    "description": "Secrets (in the InferenceService's namespace) for pulling the image, on every pod: router, "
                   "prefill and decode; added to the operator's own (the chart's imagePullSecrets).",
    "maxItems": 16,
    "items": _obj({"name": _str("A Secret of type kubernetes.io/dockerconfigjson.", minLength=1, maxLength=253)},
                  required=["name"]),
}

POOL_RULES = [
    _rule(f"!has(self.engine) || !has(self.engine.gpuMemoryUtilization) || {gpu_cel('self')}",
          f"engine.gpuMemoryUtilization needs a GPU in resources ({GPU_NAMES}); size a CPU pool's "
          "KV cache with kvCacheMemory or numBlocks", fieldPath=".engine.gpuMemoryUtilization"),
    # the vLLM backend is vLLM's CPU build (vllm_backend/): on a GPU pool it would crash-loop at start
    _rule(f"!has(self.engine) || !has(self.engine.name) || self.engine.name != 'vllm' || !{gpu_cel('self')}",
          f"engine.name vllm runs vLLM's CPU build only (no CUDA vLLM path is built and tested yet): a GPU pool "
          f"(resources name {GPU_NAMES}) needs engine.name builtin", fieldPath=".engine.name"),
]

ROLLOUT = _obj(
    {
        "maxSurge": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
                     "pattern": r"^[0-9]+%?$", "description": "Pods created above replicas during a rollout (a "
                     "number or a percentage; default 1)."},
        "maxUnavailable": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
                           "pattern": r"^[0-9]+%?$", "description": "Pods that may be missing during a rollout (a "
                           "number or a percentage; default 0: a new pod is ready before an old one drains)."},
    },
    description="How the pool's Deployment replaces its pods (default maxSurge 1, maxUnavailable 0: one new pod "
                "first, which needs room for one more pod). On a cluster whose GPUs are all in use, maxSurge 0 and "
                "maxUnavailable 1 replace one pod at a time, down then up; either way an old pod drains its "
                "requests before it stops, so no stream is lost.",
    **{"x-kubernetes-validations": [
        _rule("!(has(self.maxSurge) && has(self.maxUnavailable) && (self.maxSurge == 0 || self.maxSurge == '0' "
              "|| self.maxSurge == '0%') && (self.maxUnavailable == 0 || self.maxUnavailable == '0' "
              "|| self.maxUnavailable == '0%'))",
              "rollout: maxSurge and maxUnavailable cannot both be 0 (nothing could be replaced)"),
    ]},
)
DEFAULT_ROLLOUT = {"maxSurge": 1, "maxUnavailable": 0}

def kv_dtype_cel(pool: str) -> str:
    """CEL: the KV cache dtype of the pool object ``pool`` (engine.kvCacheDtype, else auto)."""
    return f"((has({pool}.engine) && has({pool}.engine.kvCacheDtype)) ? {pool}.engine.kvCacheDtype : 'auto')"


KV_DTYPE_RULE = {
    "rule": f"!has(self.prefill) || self.decode.all(d, {kv_dtype_cel('d')} == {kv_dtype_cel('self.prefill')})",
    "message": "spec.decode pools must use spec.prefill's engine.kvCacheDtype (default auto): the KV moves between "
               "them as is, and a prefill and a decode of different KV dtypes refuse each other",
}

DTYPE_RULE = {
    "rule": f"!has(self.prefill) || self.decode.all(d, {dtype_cel('d')} == {dtype_cel('self.prefill')})",
    "message": f"spec.decode pools must compute in spec.prefill's dtype (engine.dtype, else {GPU_DTYPE} with a GPU "
               f"in resources and {CPU_DTYPE} without): KV moves between them as is",
}
