"""The CustomResourceDefinitions: the one source of truth for the pdserve.io schema.

The chart's CRD files are generated from this module (a test checks that the committed
files equal what it generates)::

    .venv/bin/python -m pdserve.operator.crds charts/pdserve

``chart_files()`` says where each goes: the pdserve.io CRDs into ``files/crds/`` (the chart's
``templates/crds.yaml`` renders them, so ``helm upgrade`` updates them), kopf's peering CRDs into
Helm's ``crds/`` folder (charts/pdserve/README.md explains why).

The API server does all user-facing validation from these schemas (types, ranges,
enums, required fields, CEL rules) and fills in defaults, so the operator only ever
sees well-formed objects; every rule has a message that names the field.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from pdserve import defaults, model_source
from pdserve.operator import crd_parallel, crd_pod, naming
from pdserve.operator.crd_policy import AUTOSCALING, ROUTER, SLO, SLO_CLASS  # noqa: F401 - the policy layer's fragments
from pdserve.operator.crd_schema import (  # noqa: F401 - the limits and defaults are re-exported for the builders
    BACKENDS, DEFAULT_BACKEND, DEFAULT_MOUNT_PATH, DEFAULT_POLICY, DEFAULT_REPLICAS, DEFAULT_TBT_MS, DEFAULT_TTFT_MS,
    MAX_BLOCK_SIZE, MAX_DECODE_POOLS, MAX_LOAD_WEIGHT, MAX_REPLICAS, NODE_SELECTOR, POLICIES, RESOURCES, TOLERATIONS,
    _int, _obj, _rule, _str)


def _pool_properties(replicas_description: str, role: str) -> dict:
    """What a prefill or decode pool says about its pods: count, hardware, engine, pod settings."""
    return {
        "replicas": _int(replicas_description, 0, MAX_REPLICAS, DEFAULT_REPLICAS),
        "resources": RESOURCES,
        "nodeSelector": NODE_SELECTOR,
        "tolerations": TOLERATIONS,
        "engine": crd_pod.engine_schema(role),
        "parallelism": crd_parallel.PARALLELISM,
        **crd_pod.POD_SETTINGS,
        "disruptionBudget": crd_pod.DISRUPTION_BUDGET,
        "rollout": crd_pod.ROLLOUT,
    }


# the rules on one pool: its settings' (crd_pod.py), then its parallelism's (crd_parallel.py)
POOL_RULES = [*crd_pod.POOL_RULES, *crd_parallel.POOL_RULES]
_QUANTITY = RESOURCES["properties"]["limits"]["additionalProperties"]
_HF_ONLY = "self.source.startsWith('hf://')"

MODEL = _obj(
    {
        "source": _str("Where the model comes from: 'builtin:<name>' (e.g. builtin:tiny); an absolute path to a "
                       "Hugging Face safetensors checkpoint (on pvcName, or a volume of the pod settings); "
                       "'hf://org/name[@revision]': downloaded from the Hugging Face Hub into spec.model.cache (an "
                       "emptyDir: by each pod; a claim: once, by a Job); 'pvc://claim/path/inside': the claim "
                       "mounted read-only.",
                       minLength=1, maxLength=1024),
        "pvcName": _str("A PersistentVolumeClaim holding the model, mounted read-only at mountPath (with an "
                        "absolute-path source).", minLength=1, maxLength=253),
        "mountPath": _str("Where pvcName, or the claim of a pvc:// source, is mounted.", pattern="^/",
                          default=DEFAULT_MOUNT_PATH, maxLength=512),
        "servedModelName": _str("The name clients put in \"model\" (and /v1/models lists). Default: the "
                                "repository's name for hf:// (hf://Qwen/Qwen2.5-0.5B-Instruct "
                                "-> Qwen2.5-0.5B-Instruct), the last element of a path, the name of builtin:<name>.",
                                minLength=1, maxLength=256, pattern="^[^ ]+$"),
        "tokenSecret": _obj(
            {"name": _str("The Secret (in the service's namespace).", minLength=1, maxLength=253),
             "key": _str("The key holding the token.", minLength=1, maxLength=253, default="HF_TOKEN")},
            required=["name"],
            description="hf:// only: a Secret with a Hugging Face token, for gated or private repositories. Only the "
                        "init container that downloads sees it (as HF_TOKEN).",
        ),
        "endpoint": _str("hf:// only: the Hub to download from (HF_ENDPOINT), e.g. a mirror. Default "
                         "https://huggingface.co.", pattern="^https?://[^ ]+$", maxLength=512),
        "cache": _obj(
            {"sizeLimit": {**_QUANTITY, "description": "Size limit of the emptyDir each pod downloads the model "
                                                      "into (one download per pod)."},
             "pvcName": _str("A PersistentVolumeClaim of yours the model is downloaded into once, by the operator's "
                             "download Job; the pods mount it read-only and wait for the Job. ReadWriteMany when the "
                             "pods run on more than one node.", minLength=1, maxLength=253),
             "size": {**_QUANTITY, "description": "The operator makes a PersistentVolumeClaim <name>-model-cache of "
                                                 "this size (owned by the InferenceService: deleted with it), "
                                                 "downloads the model into it once with a Job, and the pods mount it "
                                                 "read-only. At least the model's size."},
             "storageClassName": _str("With size: the claim's StorageClass (default: the cluster's default "
                                      "class).", minLength=1, maxLength=253),
             "accessMode": _str("With size: the claim's access mode. ReadWriteOnce (one node at a time) serves "
                                "every pod when they all run on one node; across nodes use ReadWriteMany. Default "
                                "ReadWriteOnce.", enum=["ReadWriteOnce", "ReadWriteMany"])},
            description="hf:// only: where the model is downloaded. Default: an emptyDir per pod (one download per "
                        "pod). With pvcName or size: once per InferenceService, into a claim (status.model shows "
                        "the download).",
            **{"x-kubernetes-validations": [
                _rule("[has(self.sizeLimit), has(self.pvcName), has(self.size)].filter(x, x).size() <= 1",
                      "spec.model.cache: set one of sizeLimit (an emptyDir per pod), pvcName (your claim) or size "
                      "(a claim the operator makes)"),
                _rule("has(self.size) || !(has(self.storageClassName) || has(self.accessMode))",
                      "spec.model.cache: storageClassName and accessMode are only for a claim the operator makes "
                      "(size)")]},
        ),
    },
    required=["source"],
    description="The model both pools serve.",
    **{"x-kubernetes-validations": [
        _rule("self.source.startsWith('builtin:') || self.source.startsWith('/') || "
              f"self.source.matches('{model_source.HF_PATTERN}') || self.source.matches('{model_source.PVC_PATTERN}')",
              f"spec.model.source must be {model_source.FORMS}", fieldPath=".source"),
        _rule("!self.source.startsWith('pvc://') || !(self.source.endsWith('/..') || self.source.contains('/../'))",
              "spec.model.source: the path inside a pvc:// claim must not contain '..'", fieldPath=".source"),
        _rule("!has(self.pvcName) || self.source.startsWith(self.mountPath + '/')",
              "spec.model.source must be a path under spec.model.mountPath when spec.model.pvcName is set",
              fieldPath=".source"),
        _rule(f"!has(self.tokenSecret) || {_HF_ONLY}",
              "spec.model.tokenSecret is only for an hf:// spec.model.source", fieldPath=".tokenSecret"),
        _rule(f"!has(self.cache) || {_HF_ONLY}",
              "spec.model.cache is only for an hf:// spec.model.source", fieldPath=".cache"),
        _rule(f"!has(self.endpoint) || {_HF_ONLY}",
              "spec.model.endpoint is only for an hf:// spec.model.source", fieldPath=".endpoint"),
    ]},
)

TRANSFER = _obj(
    {
        "backend": _str("KV transfer backend: tcp (framed sockets) or nixl (UCX).", enum=BACKENDS,
                        default=DEFAULT_BACKEND),
        "blockSize": _int("KV cache block size in tokens.", 1, MAX_BLOCK_SIZE, defaults.BLOCK_SIZE),
    },
    description="How prefill pushes the KV cache to decode.",
    default={},
)

ROUTING = _obj(
    {"policy": _str("wrr: weighted round robin on free KV memory; rr: plain round robin.", enum=POLICIES,
                    default=DEFAULT_POLICY),
     "disaggregation": _str("Where each prompt is computed (`--disaggregation` of the prefills): always (on a "
                            "prefill, its KV moved to the decode), auto (per request, by a cost model of the "
                            "prefill's measured speed and queue, the link, and the decode's cached prefix and load: "
                            "e.g. a later turn whose history the decode holds may be computed there while the "
                            "prefill is busy) or never (on the decode). Unset: always.",
                            enum=list(defaults.DISAGGREGATION_MODES))},
    description="How prefill picks a decode, and where each prompt is computed.",
    default={},
)

AUTH = _obj(
    {"apiKeySecret": _str("A Secret in the service's namespace holding the API keys: one key a line, or name:key (the "
                          "name is what the metrics count requests under; blank lines and # comments ignored). "
                          "Clients send a key as 'Authorization: Bearer <key>' (the OpenAI client's api_key).",
                          minLength=1, maxLength=253, pattern=naming.DNS_SUBDOMAIN),
     "key": _str("The Secret's key that holds the key file.", minLength=1, maxLength=253,
                 pattern=r"^[-._a-zA-Z0-9]+$", default=defaults.API_KEYS_SECRET_KEY)},
    required=["apiKeySecret"],
    description="API keys at the OpenAI doors: the router and the prefills (with their Batch API) answer 401 to a "
                "request without one of the keys, on every route but /health, /ready and /metrics. The operator "
                "mounts the Secret read-only and passes it as --api-key-file; pods read it at start (restart them "
                "after changing the Secret). Unset: no keys, the doors are open. docs/security.md says what the keys "
                "stop and what they do not.",
)

IMAGE = _str("Container image with the pdserve command (default: the operator's own image).", minLength=1,
             maxLength=512)
PULL_POLICY = _str("Image pull policy of the pods.", enum=["Always", "IfNotPresent", "Never"])
PROTOCOL = _str("Protocol version the image speaks (default: the operator's). Pods are labelled with it "
                "and prefill only routes to decodes of the same version.",
                pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

DECODE_POOL_ITEM = _obj(
    {"name": _str("Pool name (a DNS label, unique in the service).", pattern=naming.DNS_LABEL,
                  maxLength=naming.MAX_POOL_NAME),
     **_pool_properties("Decode pods in this pool.", "decode")},
    required=["name"],
    **{"x-kubernetes-validations": POOL_RULES},
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
        "imagePullSecrets": crd_pod.IMAGE_PULL_SECRETS,
        "prefill": _obj({**_pool_properties("Prefill pods.", "prefill"), "batchStorage": BATCH_STORAGE},
                        description="The prefill pool (the front door when there is no router).", default={},
                        **{"x-kubernetes-validations": POOL_RULES}),
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
        "auth": AUTH,
    },
    required=["model", "decode"],
    **{"x-kubernetes-validations": [crd_pod.DTYPE_RULE, crd_pod.KV_DTYPE_RULE]},
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

MODEL_STATUS = _obj(
    {
        "source": _str("spec.model.source being downloaded."),
        "claim": _str("The claim it is downloaded into."),
        "job": _str("The download Job."),
        "phase": _str("Pending, Downloading, Downloaded or Failed."),
        "reason": _str("Why (TokenRefused, RepoNotFound, ... when Failed)."),
        "message": _str("What the download says, in words."),
        "progress": _str("Share, bytes and files done."),
        "bytesDone": {"type": "integer", "format": "int64"},
        "bytesTotal": {"type": "integer", "format": "int64"},
        "filesDone": {"type": "integer"},
        "filesTotal": {"type": "integer"},
    },
    description="The download of an hf:// model into a claim (spec.model.cache pvcName or size).",
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
        "model": MODEL_STATUS,
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
        "imagePullSecrets": crd_pod.IMAGE_PULL_SECRETS,
        **_pool_properties(f"{role.capitalize()} pods.", role),
        "transfer": TRANSFER,
        "tlsSecret": _str("The Secret of the InferenceService's certificate and CA (tls.crt, tls.key, ca.crt) its "
                          "pods mount for mutual TLS; set by the operator's --tls, absent without it.",
                          pattern=naming.DNS_SUBDOMAIN, maxLength=253),
    }
    required = ["inferenceService", "model", "image", "protocolVersion"]
    if role == "prefill":
        properties.update({"routing": ROUTING, "slo": SLO, "batchStorage": BATCH_STORAGE, "auth": AUTH})
    else:
        properties["poolName"] = _str("The pool's name in the InferenceService.", pattern=naming.DNS_LABEL,
                                      maxLength=naming.MAX_POOL_NAME)
        required.append("poolName")
    return _obj(properties, required=required, **{"x-kubernetes-validations": POOL_RULES})


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
         {"name": "Prefill", "type": "string", "jsonPath": ".status.prefillReady",
          "description": "ready/desired prefill pods"},
         {"name": "Decode", "type": "string", "jsonPath": ".status.decodeReady",
          "description": "ready/desired decode pods"},
         {"name": "Router", "type": "string", "jsonPath": ".status.routerReady",
          "description": "ready/desired router pods",
          "priority": 1},
         {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
         {"name": "Model", "type": "string", "jsonPath": ".status.model.phase",
          "description": "the download of an hf:// model into a claim", "priority": 1}],
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


HEADER = "# Generated by `python -m pdserve.operator.crds charts/pdserve` from operator/crds.py. Do not edit.\n"

# Where the chart keeps each CRD. The pdserve.io ones are templates (charts/pdserve/templates/crds.yaml
# renders files/crds/*.yaml unless crds.install is false): `helm upgrade` updates their schemas with the
# operator that reads them, and `helm.sh/resource-policy: keep` leaves them, and so every user's
# InferenceService, in place on `helm uninstall`. kopf's peering CRDs stay in Helm's crds/ folder, which
# Helm applies before the templates and never upgrades: the chart creates a peering object of them
# (templates/peering.yaml), and Helm cannot create a CRD and an object of it from templates in one
# install; their schema is kopf's own and does not change.
TEMPLATED_DIR = "files/crds"
PLAIN_DIR = "crds"
KEEP = {"helm.sh/resource-policy": "keep"}


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared sub-schemas out in full (API servers and readers want no YAML anchors)."""

    def ignore_aliases(self, data) -> bool:
        return True


def render(crd: dict) -> str:
    return HEADER + yaml.dump(crd, Dumper=_NoAliasDumper, sort_keys=False, width=120)


def chart_crd(crd: dict) -> tuple[str, dict]:
    """(folder inside the chart, the CRD as the chart holds it) for one CRD of all_crds()."""
    if crd["spec"]["group"] != "pdserve.io":
        return PLAIN_DIR, crd
    metadata = {**crd["metadata"], "annotations": {**crd["metadata"].get("annotations", {}), **KEEP}}
    return TEMPLATED_DIR, {**crd, "metadata": metadata}


def chart_files() -> dict[str, str]:
    """Path inside the chart -> its text, for every CRD file the chart holds."""
    files = {}
    for name, crd in all_crds().items():
        folder, held = chart_crd(crd)
        files[f"{folder}/{name}"] = render(held)
    return files


def write(chart_dir: Path) -> list[Path]:
    """Write chart_files() into chart_dir, removing CRD files it no longer holds."""
    files = chart_files()
    for folder in (TEMPLATED_DIR, PLAIN_DIR):
        (chart_dir / folder).mkdir(parents=True, exist_ok=True)
        for stale in (chart_dir / folder).glob("*.yaml"):
            if f"{folder}/{stale.name}" not in files:
                stale.unlink()
    written = []
    for relative, text in files.items():
        path = chart_dir / relative
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the pdserve CRDs (and kopf's peering CRDs) into the chart.")
    parser.add_argument("chart_dir", type=Path, help="the chart's folder: charts/pdserve")
    args = parser.parse_args(argv)
    if not (args.chart_dir / "Chart.yaml").is_file():
        parser.error(f"{args.chart_dir} has no Chart.yaml: give the chart's folder, charts/pdserve")
    for path in write(args.chart_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
