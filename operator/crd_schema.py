"""The CRD schema's building blocks and limits (pure data): the helpers every fragment uses
(``_obj``, ``_str``, ``_int``, ``_rule``), the hardware settings every pool shares (resources,
tolerations, node selector) and the defaults and bounds the schema and the builders share.
``crds.py`` assembles the CustomResourceDefinitions from these, ``crd_pod.py`` (engine and pod
settings) and ``crd_policy.py``."""

from __future__ import annotations

# Defaults the schema fills in; builders fall back to the same values for objects that
# never passed through an API server (unit tests).
DEFAULT_REPLICAS = 1
DEFAULT_BACKEND = "tcp"
DEFAULT_POLICY = "wrr"
DEFAULT_MOUNT_PATH = "/models"
DEFAULT_TTFT_MS = 1000
DEFAULT_TBT_MS = 100
BACKENDS = ["tcp", "nixl"]  # = pdserve.cachestore.TRANSPORTS (checked by tests/unit/test_operator_crds.py)
POLICIES = ["wrr", "rr"]
MAX_REPLICAS = 1000
MAX_DECODE_POOLS = 16
MAX_BLOCK_SIZE = 1024
MAX_LOAD_WEIGHT = 1_000_000
MAX_RESOURCE_NAMES = 32  # per limits / requests map (a bound keeps the CEL rules that read them cheap)


def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    schema = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = required
    return schema


def _str(description: str, **extra) -> dict:
    return {"type": "string", "description": description, **extra}


def _int(description: str, minimum: int, maximum: int, default: int | None = None) -> dict:
    schema = {"type": "integer", "description": description, "minimum": minimum, "maximum": maximum}
    if default is not None:
        schema["default"] = default
    return schema


def _rule(rule: str, message: str, **extra) -> dict:
    return {"rule": rule, "message": message, **extra}


_QUANTITY = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    "pattern": (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"),
}

RESOURCES = _obj(
    {
        "limits": {"type": "object", "description": "Resource limits, e.g. {cpu: 4, memory: 16Gi, nvidia.com/gpu: 1, "
                                                    "rdma/hca_shared_devices_a: 1}: any resource name.",
                   "additionalProperties": _QUANTITY, "maxProperties": MAX_RESOURCE_NAMES},
        "requests": {"type": "object", "description": "Resource requests (as in a Pod).",
                     "additionalProperties": _QUANTITY, "maxProperties": MAX_RESOURCE_NAMES},
    },
    description="Compute resources of each pod of the pool (as in a Pod's container).",
)

TOLERATIONS = {
    "type": "array",
    "description": "Tolerations of the pool's pods (as in a Pod).",
    "maxItems": 32,
    "items": _obj({
        "key": _str("Taint key.", maxLength=316),
        "operator": _str("Exists or Equal.", enum=["Exists", "Equal"]),
        "value": _str("Taint value.", maxLength=63),
        "effect": _str("NoSchedule, PreferNoSchedule or NoExecute.",
                       enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": {"type": "integer", "format": "int64",
                              "description": "How long a NoExecute taint is tolerated."},
    }),
}

NODE_SELECTOR = {
    "type": "object",
    "description": "Node labels the pool's pods must run on (as in a Pod); pools may differ in hardware.",
    "additionalProperties": {"type": "string"},
    "maxProperties": 32,
}
