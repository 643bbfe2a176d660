"""A protocol rollout without a gap: a decode pool's Service for the old protocol version stays
until every prefill speaks the new one.

Lifecycle of a ``spec.protocolVersion`` change (say 3 -> 4) of an InferenceService:

1. The DecodePool's reconcile finds its Service still labelled 3. Before relabelling it to 4
   it applies a *retired* copy (``retired_service``): named ``<service>-v3``, the old labels
   plus ``pdserve.io/retired``, the old selector. Its EndpointSlices carry version 3, so a
   version-3 prefill (its ``--decode-selector`` names 3) keeps finding the version-3 decode
   pods while they roll away, instead of finding none at once and turning NotReady.
2. Both Deployments roll: new prefills find the version-4 decodes through the main Service.
3. On each Deployment event the status refresh calls ``prune``: a retired Service goes once
   the prefill Deployment runs only pods of another version (rolled: observed, every replica
   updated, no old pod left), or when the pool's current version is its own again (a roll
   back: the main Service selects those pods).

The retired Service is adopted by its DecodePool, so deleting the pool deletes it too.
"""

from __future__ import annotations

import hashlib
import re

from pdserve.operator import naming

MAX_NAME = 63  # a Service name is an RFC 1035 label


def retired_name(service: str, version: str) -> str:
    """``<service>-v<version>`` as a valid Service name (hashed when it would be too long)."""
    suffix = "-v" + re.sub(r"[^a-z0-9]+", "-", version.lower()).strip("-")
    if len(service) + len(suffix) <= MAX_NAME and suffix != "-v":
        return service + suffix
    digest = hashlib.blake2b(f"{service}/{version}".encode(), digest_size=4).hexdigest()
    return f"{service[:MAX_NAME - len(digest) - 2]}-r{digest}"


def retired_service(current: dict | None, wanted: dict) -> dict | None:
    """The retired copy of the decode Service ``current`` (as the API server has it) when ``wanted``
    (the Service the pool is about to apply) changes its protocol version; else None."""
    if not current:
        return None
    labels = dict(current["metadata"].get("labels") or {})
    old = labels.get(naming.LABEL_PROTOCOL)
    new = wanted["metadata"]["labels"].get(naming.LABEL_PROTOCOL)
    if old is None or old == new or labels.get(naming.LABEL_RETIRED):
        return None
    metadata = {"name": retired_name(current["metadata"]["name"], old),
                "labels": {**labels, naming.LABEL_RETIRED: "true"}}
    if current["metadata"].get("namespace"):
        metadata["namespace"] = current["metadata"]["namespace"]
    spec = current["spec"]
    ports = [{k: p[k] for k in ("name", "port", "targetPort", "protocol") if k in p} for p in spec.get("ports", [])]
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
            "spec": {"selector": dict(spec.get("selector") or {}), "ports": ports, "clusterIP": "None",
                     "publishNotReadyAddresses": False}}


def _rolled(deployment: dict) -> bool:
    """Every replica of the Deployment runs its current template (no pod of an older one is left)."""
    spec, status = deployment.get("spec", {}), deployment.get("status", {})
    want = spec.get("replicas", 1)
    return (status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
            and status.get("updatedReplicas", 0) == want and status.get("replicas", 0) == want)


def stale(retired: list[dict], prefill: dict | None, decode_versions: dict[str, str]) -> list[str]:
    """Names of the retired Services to delete now.

    retired: the InferenceService's retired decode Services; prefill: its prefill Deployment (None:
    gone, nothing needs the old decodes); decode_versions: DecodePool object name -> its version now.
    """
    prefill_version = None
    if prefill is not None:
        prefill_version = prefill["spec"]["template"]["metadata"]["labels"].get(naming.LABEL_PROTOCOL)
    out = []
    for svc in retired:
        labels = svc["metadata"].get("labels") or {}
        version = labels.get(naming.LABEL_PROTOCOL)
        owner = naming.decode_name(labels.get(naming.LABEL_ISVC, ""), labels.get(naming.LABEL_POOL, ""))
        rolled_away = prefill is None or (prefill_version != version and _rolled(prefill))
        if rolled_away or decode_versions.get(owner) == version:
            out.append(svc["metadata"]["name"])
    return sorted(out)


def prune(api, namespace: str, isvc_name: str, deployments: dict[str, dict]) -> list[str]:
    """Delete the retired decode Services of an InferenceService that nothing needs any more; their names.

    The pools' versions are read after the retired Services: a retired copy exists only once its
    pool's spec has the new version, so this order never sees the copy with the old version (read
    before it, a copy made meanwhile by the pool's reconcile was deleted at once)."""
    retired = api.list("Service", namespace, {naming.LABEL_ISVC: isvc_name, naming.LABEL_RETIRED: "true"})
    if not retired:
        return []
    decode_pools = api.list("DecodePool", namespace, {naming.LABEL_ISVC: isvc_name})
    versions = {p["metadata"]["name"]: p["spec"].get("protocolVersion") for p in decode_pools}
    names = stale(retired, deployments.get(naming.prefill_name(isvc_name)), versions)
    for name in names:
        api.delete("Service", namespace, name)
    return names
