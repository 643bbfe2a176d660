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

from pdserve.operator import crd_parallel, crd_pod, naming
from pdserve.operator.crd_service import (  # noqa: F401 - the service-wide sections, re-exported for the builders
    AUTH, BATCH_STORAGE, IMAGE, MODEL, PROTOCOL, PULL_POLICY, ROUTING, TRANSFER)
from pdserve.operator.crd_status import ISVC_STATUS, POOL_STATUS
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
DECODE_POOL_ITEM = _obj(
    {"name": _str("Pool name (a DNS label, unique in the service).", pattern=naming.DNS_LABEL,
                  maxLength=naming.MAX_POOL_NAME),
     **_pool_properties("Decode pods in this pool.", "decode")},
    required=["name"],
    **{"x-kubernetes-validations": POOL_RULES},
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
