"""The CustomResourceDefinitions: the one source of truth for the pdserve.io schema.

``charts/pdserve/crds/*.yaml`` is generated from this module (a test checks that the
committed files equal what it generates)::

    .venv/bin/python -m pdserve.operator.crds charts/pdserve/crds

The API server does all user-facing validation from these schemas (types, ranges,
enums, required fields, CEL rules) and fills in defaults, so the operator only ever
sees well-formed objects; every rule has a message that names the field.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from pdserve import defaults
from pdserve.operator import naming
from pdserve.slo import classes as slo_classes

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


# --- schema building blocks ------------------------------------------------------------

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
    "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
}

RESOURCES = _obj(
    {
        "limits": {"type": "object", "description": "Resource limits, e.g. {cpu: 4, memory: 16Gi, nvidia.com/gpu: 1}.",
                   "additionalProperties": _QUANTITY},
        "requests": {"type": "object", "description": "Resource requests (as in a Pod).",
                     "additionalProperties": _QUANTITY},
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
        "effect": _str("NoSchedule, PreferNoSchedule or NoExecute.", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": {"type": "integer", "format": "int64", "description": "How long a NoExecute taint is tolerated."},
    }),
}

NODE_SELECTOR = {
    "type": "object",
    "description": "Node labels the pool's pods must run on (as in a Pod); pools may differ in hardware.",
    "additionalProperties": {"type": "string"},
    "maxProperties": 32,
}


def _pool_properties(replicas_description: str) -> dict:
    return {
        "replicas": _int(replicas_description, 0, MAX_REPLICAS, DEFAULT_REPLICAS),
        "resources": RESOURCES,
        "nodeSelector": NODE_SELECTOR,
        "tolerations": TOLERATIONS,
    }


MODEL = _obj(
    {
        "source": _str("'builtin:<name>' (e.g. builtin:tiny) or an absolute path to a Hugging Face "
                       "safetensors checkpoint on a mounted volume.", minLength=1, maxLength=1024),
        "pvcName": _str("A PersistentVolumeClaim holding the model, mounted read-only at mountPath.",
                        minLength=1, maxLength=253),
        "mountPath": _str("Where pvcName is mounted.", pattern="^/", default=DEFAULT_MOUNT_PATH, maxLength=512),
    },
    required=["source"],
    description="The model both pools serve.",
    **{"x-kubernetes-validations": [
        _rule("self.source.startsWith('builtin:') || self.source.startsWith('/')",
              "spec.model.source must be 'builtin:<name>' or an absolute path", fieldPath=".source"),
        _rule("!has(self.pvcName) || self.source.startsWith(self.mountPath + '/')",
              "spec.model.source must be a path under spec.model.mountPath when spec.model.pvcName is set",
              fieldPath=".source"),
    ]},
)

TRANSFER = _obj(
    {
        "backend": _str("KV transfer backend: tcp (framed sockets) or nixl (UCX).", enum=BACKENDS, default=DEFAULT_BACKEND),
        "blockSize": _int("KV cache block size in tokens.", 1, MAX_BLOCK_SIZE, defaults.BLOCK_SIZE),
    },
    description="How prefill pushes the KV cache to decode.",
    default={},
)

ROUTING = _obj(
    {"policy": _str("wrr: weighted round robin on free KV memory; rr: plain round robin.", enum=POLICIES,
                    default=DEFAULT_POLICY)},
    description="How prefill picks a decode.",
    default={},
)

def _slo_targets(default_ttft: int | None = None, default_tbt: int | None = None) -> dict:
    return {
        "ttftMs": _int("Time-to-first-token target in milliseconds.", 1, 600_000, default_ttft),
        "tbtMs": _int("Target of a request's mean time between tokens, in milliseconds.", 1, 60_000, default_tbt),
        "e2eMs": _int("End-to-end target (arrival to last token) in milliseconds.", 1, slo_classes.MAX_TARGET_MS),
        "earlyReject": {"type": "boolean", "default": False,
                        "description": "Refuse a request at once (429 with Retry-After and the estimate) when the "
                                       "estimate says its targets cannot be met even if it were served next; batch "
                                       "classes usually queue instead."},
    }


SLO_CLASS = _obj(
    {"name": _str("Class name: the X-SLO-Class header's value and the slo_class metric label.",
                  pattern=slo_classes.NAME_PATTERN, maxLength=63),
     **_slo_targets(),
     "priority": _int("The vLLM request field 'priority' value that selects this class (0, when no class "
                      "declares it, selects defaultClass).", -1_000_000, 1_000_000)},
    required=["name"],
)

SLO = _obj(
    {
        **_slo_targets(DEFAULT_TTFT_MS, DEFAULT_TBT_MS),
        "defaultClass": _str("The class of requests that name none: 'default' (this object's own targets) or "
                             "one of classes.", pattern=slo_classes.NAME_PATTERN, maxLength=63,
                             default=slo_classes.DEFAULT_CLASS),
        "classes": {
            "type": "array",
            "description": "Named SLO classes besides 'default' (e.g. interactive, batch); a request picks one with "
                           "the header X-SLO-Class or the body field priority.",
            "maxItems": slo_classes.MAX_CLASSES,
            "items": SLO_CLASS,
            "x-kubernetes-validations": [
                _rule("self.all(c, self.exists_one(d, d.name == c.name))", "spec.slo.classes names must be unique"),
                _rule("self.all(c, c.name != 'default')",
                      "spec.slo.classes must not declare 'default': it is the class of spec.slo's own targets"),
                _rule("self.all(c, !has(c.priority) || self.exists_one(d, has(d.priority) && d.priority == c.priority))",
                      "spec.slo.classes priorities must be unique"),
            ],
        },
    },
    description="Latency targets (SLOs): the class 'default' from ttftMs/tbtMs/e2eMs, plus named classes. Passed "
                "to prefill pods as PDSERVE_SLO_CLASSES; their queue orders, rejects and reports by class.",
    default={},
    **{"x-kubernetes-validations": [
        _rule("!has(self.defaultClass) || self.defaultClass == 'default' || "
              "(has(self.classes) && self.classes.exists(c, c.name == self.defaultClass))",
              "spec.slo.defaultClass must be 'default' or the name of one of spec.slo.classes",
              fieldPath=".defaultClass"),
    ]},
)

ROUTER = _obj(
    {
        "replicas": _int("Router pods: the front door, each request to the prefill holding most of its prompt's KV "
                         "(0: no router, the prefill Service is the front door). Replicas decide alike from the same "
                         "KV events, so any number may run.", 0, MAX_REPLICAS, DEFAULT_REPLICAS),
        "resources": RESOURCES,
        "nodeSelector": NODE_SELECTOR,
        "tolerations": TOLERATIONS,
        "loadWeight": {"type": "number", "minimum": 0, "maximum": MAX_LOAD_WEIGHT,
                       "description": "Prompt tokens one request in flight on a prefill is worth when weighing load "
                                      "against its cached prefix (`pdserve router --load-weight`; default: the "
                                      "router's)."},
    },
    description="The KV-aware router in front of the prefill pool (pdserve router).",
    default={},
)

def _autoscaling_bounds(pool: str, default_max: int) -> dict:
    return _obj(
        {"minReplicas": _int(f"Fewest {pool} pods the planner keeps.", 1, MAX_REPLICAS, 1),
         "maxReplicas": _int(f"Most {pool} pods the planner runs.", 1, MAX_REPLICAS, default_max)},
        description=f"Bounds of the {pool} pool{' (each decode pool)' if pool == 'decode' else ''}.",
        default={"minReplicas": 1, "maxReplicas": default_max},
        **{"x-kubernetes-validations": [_rule("self.minReplicas <= self.maxReplicas",
                                              f"spec.autoscaling.{pool}.minReplicas must be <= maxReplicas")]},
    )


AUTOSCALING = _obj(
    {
        "enabled": {"type": "boolean", "default": False,
                    "description": "Let the operator's planner set the pools' replicas (through their scale "
                                   "subresource) to meet spec.slo. Off: replicas are yours (kubectl scale, the spec)."},
        "prefill": _autoscaling_bounds("prefill", 4),
        "decode": _autoscaling_bounds("decode", 4),
        "intervalSeconds": _int("Seconds between two decisions.", 1, 3600, 15),
        "windowSeconds": _int("Seconds of metrics one decision looks at.", 5, 3600, 60),
        "scaleDownStabilizationSeconds": _int("A pool shrinks only to the highest need of this many seconds.",
                                              0, 86400, 300),
        "cooldownSeconds": _int("Seconds after a change of a pool before it may shrink.", 0, 86400, 60),
    },
    description="The SLO planner (pdserve.planner): scale up fast on bursts, down slowly, one drained pod at a time.",
    default={},
)

IMAGE = _str("Container image with the pdserve command (default: the operator's own image).", minLength=1, maxLength=512)
PULL_POLICY = _str("Image pull policy of the pods.", enum=["Always", "IfNotPresent", "Never"])
PROTOCOL = _str("Protocol version the image speaks (default: the operator's). Pods are labelled with it "
                "and prefill only routes to decodes of the same version.", pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

DECODE_POOL_ITEM = _obj(
    {"name": _str("Pool name (a DNS label, unique in the service).", pattern=naming.DNS_LABEL, maxLength=naming.MAX_POOL_NAME),
     **_pool_properties("Decode pods in this pool.")},
    required=["name"],
)

BATCH_STORAGE = _obj(
    {
        "pvcName": _str(f"A PersistentVolumeClaim for the database, mounted read-write at {defaults.BATCH_DATA_MOUNT} "
                        "(jobs then survive the pod). One prefill per database: with a ReadWriteOnce claim run one "
                        "prefill replica.", minLength=1, maxLength=253),
    },
    description="Where prefill pods keep the OpenAI Batch API's jobs and files (a SQLite database, docs/batch.md). "
                "Without pvcName: in the pod's emptyDir, which survives container restarts but not the pod.",
)

ISVC_SPEC = _obj(
    {
        "model": MODEL,
        "image": IMAGE,
        "imagePullPolicy": PULL_POLICY,
        "protocolVersion": PROTOCOL,
        "prefill": _obj({**_pool_properties("Prefill pods."), "batchStorage": BATCH_STORAGE}, description="The prefill pool (the front door when "
                        "there is no router).", default={}),
        "router": ROUTER,
        "decode": {
            "type": "array",
            "description": "One or more named decode pools; they may differ in hardware.",
            "minItems": 1,
            "maxItems": MAX_DECODE_POOLS,
            "items": DECODE_POOL_ITEM,
            "x-kubernetes-validations": [
                _rule("self.all(p, self.exists_one(q, q.name == p.name))", "spec.decode pool names must be unique"),
            ],
        },
        "transfer": TRANSFER,
        "routing": ROUTING,
        "slo": SLO,
        "autoscaling": AUTOSCALING,
    },
    required=["model", "decode"],
)

CONDITIONS = {
    "type": "array",
    "description": "Ready, Progressing and Degraded, each with a reason.",
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
    "items": _obj(
        {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "format": "int64"},
        },
        required=["type", "status"],
    ),
}

POOL_STATUS_ITEM = _obj({
    "name": {"type": "string"},
    "replicas": {"type": "integer"},
    "readyReplicas": {"type": "integer"},
    "ready": {"type": "boolean"},
})

AUTOSCALING_STATUS = _obj(
    {
        "source": _str("Where the planner read its metrics: prometheus or pods."),
        "lastDecisionTime": {"type": "string", "format": "date-time"},
        "pools": {
            "type": "array",
            "description": "The last decision for each pool: desired vs current replicas, and why.",
            "items": _obj({
                "name": _str("The pool object (PrefillPool or DecodePool)."),
                "role": _str("prefill or decode."),
                "current": {"type": "integer"},
                "desired": {"type": "integer"},
                "ready": {"type": "integer"},
                "signal": _str("What drove the decision: kv, busy, queue, ttft, tbt, idle, steady, hold, bounds, ..."),
                "reason": _str("The planner's reason, in words."),
                "lastScaleTime": {"type": "string", "format": "date-time"},
                "lastScaleReason": {"type": "string"},
            }),
        },
    },
    description="What the planner decided last (spec.autoscaling.enabled).",
)

ISVC_STATUS = _obj(
    {
        "observedGeneration": {"type": "integer", "format": "int64"},
        "conditions": CONDITIONS,
        "endpoint": _str("The OpenAI-compatible HTTP endpoint: the router Service, or the prefill Service "
                         "when spec.router.replicas is 0."),
        "prefillReady": _str("Ready/desired prefill pods."),
        "routerReady": _str("Ready/desired router pods (absent without a router)."),
        "router": POOL_STATUS_ITEM,
        "decodeReady": _str("Ready/desired decode pods over all pools."),
        "protocolVersion": {"type": "string"},
        "prefill": POOL_STATUS_ITEM,
        "decode": {"type": "array", "items": POOL_STATUS_ITEM},
        "autoscaling": AUTOSCALING_STATUS,
    },
    **{"x-kubernetes-preserve-unknown-fields": True},
)

POOL_STATUS = _obj(
    {
        "observedGeneration": {"type": "integer", "format": "int64"},
        "conditions": CONDITIONS,
        "replicas": {"type": "integer", "description": "Pods the Deployment has (scale subresource)."},
        "readyReplicas": {"type": "integer"},
        "updatedReplicas": {"type": "integer"},
        "selector": _str("Label selector of the pool's pods (scale subresource)."),
    },
    **{"x-kubernetes-preserve-unknown-fields": True},
)


def _pool_spec(role: str) -> dict:
    properties = {
        "inferenceService": _str("The owning InferenceService.", minLength=1, maxLength=naming.MAX_ISVC_NAME),
        "model": MODEL,
        "image": IMAGE,
        "imagePullPolicy": PULL_POLICY,
        "protocolVersion": PROTOCOL,
        **_pool_properties(f"{role.capitalize()} pods."),
        "transfer": TRANSFER,
    }
    required = ["inferenceService", "model", "image", "protocolVersion"]
    if role == "prefill":
        properties.update({"routing": ROUTING, "slo": SLO, "batchStorage": BATCH_STORAGE})
    else:
        properties["poolName"] = _str("The pool's name in the InferenceService.", pattern=naming.DNS_LABEL,
                                      maxLength=naming.MAX_POOL_NAME)
        required.append("poolName")
    return _obj(properties, required=required)


# --- the CRDs --------------------------------------------------------------------------

_READY = '.status.conditions[?(@.type=="Ready")].status'
_AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def _crd(kind: str, plural: str, short: str, spec: dict, status: dict, columns: list[dict],
         root_rules: list[dict], scale: bool) -> dict:
    subresources: dict = {"status": {}}
    if scale:
        subresources["scale"] = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                                 "labelSelectorPath": ".status.selector"}
    schema = _obj({"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
                   "spec": spec, "status": status}, required=["spec"])
    if root_rules:
        schema["x-kubernetes-validations"] = root_rules
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{naming.GROUP}", "labels": {"app.kubernetes.io/name": "pdserve"}},
        "spec": {
            "group": naming.GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower(),
                      "shortNames": [short], "categories": ["pdserve"]},
            "versions": [{
                "name": naming.VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": schema},
                "subresources": subresources,
                "additionalPrinterColumns": [*columns, _AGE],
            }],
        },
    }


_NAME_RULE = _rule(
    f"size(self.metadata.name) <= {naming.MAX_ISVC_NAME} && self.metadata.name.matches('{naming.DNS_LABEL}')",
    f"metadata.name must be a DNS label of at most {naming.MAX_ISVC_NAME} characters starting with a letter "
    "(it prefixes the names of the pools, Deployments and Services)",
)


def inferenceservice_crd() -> dict:
    return _crd(
        "InferenceService", "inferenceservices", "pdis", ISVC_SPEC, ISVC_STATUS,
        [{"name": "Ready", "type": "string", "jsonPath": _READY},
         {"name": "Prefill", "type": "string", "jsonPath": ".status.prefillReady", "description": "ready/desired prefill pods"},
         {"name": "Decode", "type": "string", "jsonPath": ".status.decodeReady", "description": "ready/desired decode pods"},
         {"name": "Router", "type": "string", "jsonPath": ".status.routerReady", "description": "ready/desired router pods",
          "priority": 1},
         {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"}],
        [_NAME_RULE], scale=False)


def _pool_crd(kind: str, plural: str, short: str, role: str) -> dict:
    return _crd(
        kind, plural, short, _pool_spec(role), POOL_STATUS,
        [{"name": "Service", "type": "string", "jsonPath": ".spec.inferenceService"},
         {"name": "Ready", "type": "string", "jsonPath": _READY},
         {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
         {"name": "Available", "type": "integer", "jsonPath": ".status.readyReplicas"},
         {"name": "Protocol", "type": "string", "jsonPath": ".spec.protocolVersion", "priority": 1}],
        [], scale=True)


def prefillpool_crd() -> dict:
    return _pool_crd("PrefillPool", "prefillpools", "pdpp", "prefill")


def decodepool_crd() -> dict:
    return _pool_crd("DecodePool", "decodepools", "pddp", "decode")


def _kopf_peering_crd(kind: str, plural: str, scope: str) -> dict:
    """kopf's peering objects (HA: operators see each other; the highest priority one works)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev", "labels": {"app.kubernetes.io/name": "pdserve"}},
        "spec": {
            "group": "kopf.dev",
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}},
            }],
        },
    }


def all_crds() -> dict[str, dict]:
    """File name -> CRD, in the order they are written."""
    return {
        "inferenceservices.yaml": inferenceservice_crd(),
        "prefillpools.yaml": prefillpool_crd(),
        "decodepools.yaml": decodepool_crd(),
        "kopf-peerings.yaml": _kopf_peering_crd("KopfPeering", "kopfpeerings", "Namespaced"),
        "kopf-clusterpeerings.yaml": _kopf_peering_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
    }


HEADER = "# Generated by `python -m pdserve.operator.crds charts/pdserve/crds` from operator/crds.py. Do not edit.\n"


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared sub-schemas out in full (API servers and readers want no YAML anchors)."""

    def ignore_aliases(self, data) -> bool:
        return True


def render(crd: dict) -> str:
    return HEADER + yaml.dump(crd, Dumper=_NoAliasDumper, sort_keys=False, width=120)


def write(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, crd in all_crds().items():
        path = out_dir / name
        path.write_text(render(crd))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the pdserve CRDs (and kopf's peering CRDs) as YAML.")
    parser.add_argument("out_dir", type=Path, help="folder to write into, e.g. charts/pdserve/crds")
    args = parser.parse_args(argv)
    for path in write(args.out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
