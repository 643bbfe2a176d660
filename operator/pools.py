"""Pure builders: an InferenceService -> its PrefillPool, DecodePools and NetworkPolicies.

Each pool is self-contained (image, model, protocol version, transfer settings), so the
pool handlers build Deployments and Services from the pool alone. The functions return
plain dicts without owner references; the handler adopts them (``kopf.adopt``).
"""

from __future__ import annotations

from pdserve import defaults
from pdserve.operator import crd_pod, crds, naming, parallelism
from pdserve.operator.config import OperatorConfig
from pdserve.operator.pod_settings import uses_nvidia_gpu


def _meta(body: dict) -> tuple[str, str | None]:
    meta = body.get("metadata", {})
    return meta["name"], meta.get("namespace")


def _with_defaults(spec: dict) -> dict:
    """The parts of an InferenceService spec every pool shares, with schema defaults filled in."""
    model = {"mountPath": crds.DEFAULT_MOUNT_PATH, **spec["model"]}
    transfer = {"backend": crds.DEFAULT_BACKEND, "blockSize": defaults.BLOCK_SIZE, **spec.get("transfer", {})}
    return {"model": model, "transfer": transfer}


def protocol_version(isvc: dict, config: OperatorConfig) -> str:
    return naming.protocol_label(isvc["spec"].get("protocolVersion") or config.protocol_version)


def pool_replicas(isvc_replicas: int, existing: dict | None) -> int:
    """Replicas to write into a pool.

    The InferenceService's value wins when the pool is new or that value changed since it
    was last copied (the pool's ``pdserve.io/isvc-replicas`` annotation); otherwise the
    pool keeps its own value, so ``kubectl scale`` on a pool lasts until the
    InferenceService's count changes.
    """
    if existing is None:
        return isvc_replicas
    copied = existing.get("metadata", {}).get("annotations", {}).get(naming.ANNOTATION_ISVC_REPLICAS)
    if copied != str(isvc_replicas):
        return isvc_replicas
    return int(existing.get("spec", {}).get("replicas", isvc_replicas))


def _pool(kind: str, name: str, namespace: str | None, isvc_name: str, role: str, pool: str, version: str,
          replicas: int, spec: dict, isvc_replicas: int, isvc_generation: int | None) -> dict:
    metadata = {
        "name": name,
        "labels": naming.common_labels(isvc_name, role, pool, version),
        "annotations": {naming.ANNOTATION_ISVC_REPLICAS: str(isvc_replicas)},
    }
    if isvc_generation is not None:
        metadata["annotations"][naming.ANNOTATION_OWNER_GENERATION] = str(isvc_generation)
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": naming.API_VERSION, "kind": kind, "metadata": metadata,
            "spec": {**spec, "replicas": replicas}}


# What a pool (or the router) copies from its own part of the InferenceService (spec.prefill,
# spec.decode[i], spec.router): its hardware, engine, parallelism (crd_parallel.py) and pod settings (crd_pod.py).
POD_KEYS = ("resources", "nodeSelector", "tolerations", "engine", "parallelism", *crd_pod.POD_SETTINGS,
            "disruptionBudget", "rollout")


def image_pull_secrets(isvc: dict, config: OperatorConfig) -> list[dict]:
    """The InferenceService's spec.imagePullSecrets, then the operator's own (the chart's), once each."""
    names = [s["name"] for s in isvc["spec"].get("imagePullSecrets") or []] + list(config.image_pull_secrets)
    return [{"name": n} for n in dict.fromkeys(names)]


def default_image(config: OperatorConfig, pod_settings: dict) -> str:
    """The image of a pool whose InferenceService names none: the operator's CUDA image where the pool
    asks for an NVIDIA GPU (pod_settings.uses_nvidia_gpu), else its default image."""
    return config.cuda_image if config.cuda_image and uses_nvidia_gpu(pod_settings) else config.default_image


def shared_spec(isvc: dict, config: OperatorConfig, pod_settings: dict) -> dict:
    """What every pool (and the router) takes from the InferenceService, plus its own hardware,
    engine and pod settings (``POD_KEYS``) from ``pod_settings``."""
    spec = isvc["spec"]
    name, _ = _meta(isvc)
    out = {
        "inferenceService": name,
        "image": spec.get("image") or default_image(config, pod_settings),
        "protocolVersion": protocol_version(isvc, config),
        **_with_defaults(spec),
    }
    if spec.get("imagePullPolicy"):
        out["imagePullPolicy"] = spec["imagePullPolicy"]
    if image_pull_secrets(isvc, config):
        out["imagePullSecrets"] = image_pull_secrets(isvc, config)
    if config.tls != "off":  # mutual TLS: the pods mount this Secret (tls_pods.py; tls_issuer.py fills it)
        out["tlsSecret"] = naming.tls_secret_name(name)
    for key in POD_KEYS:
        if pod_settings.get(key) not in (None, {}, []):
            out[key] = pod_settings[key]
    return out


def build_prefill_pool(isvc: dict, config: OperatorConfig, existing: dict | None = None) -> dict:
    """The PrefillPool of an InferenceService (existing: the pool as it is now, or None)."""
    name, namespace = _meta(isvc)
    spec = isvc["spec"]
    prefill = spec.get("prefill", {})
    pool_spec = shared_spec(isvc, config, prefill)
    pool_spec["routing"] = {"policy": crds.DEFAULT_POLICY, **spec.get("routing", {})}
    pool_spec["slo"] = {"ttftMs": crds.DEFAULT_TTFT_MS, "tbtMs": crds.DEFAULT_TBT_MS, **spec.get("slo", {})}
    if prefill.get("batchStorage"):
        pool_spec["batchStorage"] = prefill["batchStorage"]
    if spec.get("auth"):  # the API keys: the prefill's HTTP port is a door too (the router's is rendered from spec)
        pool_spec["auth"] = spec["auth"]
    isvc_replicas = int(prefill.get("replicas", crds.DEFAULT_REPLICAS))
    return _pool("PrefillPool", naming.prefill_name(name), namespace, name, "prefill", "prefill",
                 pool_spec["protocolVersion"], pool_replicas(isvc_replicas, existing), pool_spec, isvc_replicas,
                 isvc["metadata"].get("generation"))


def build_decode_pools(isvc: dict, config: OperatorConfig, existing: dict[str, dict] | None = None) -> list[dict]:
    """One DecodePool per ``spec.decode`` entry (existing: pool object name -> pool as it is now)."""
    name, namespace = _meta(isvc)
    existing = existing or {}
    pools = []
    for entry in isvc["spec"]["decode"]:
        pool_name = entry["name"]
        object_name = naming.decode_name(name, pool_name)
        pool_spec = shared_spec(isvc, config, entry)
        pool_spec["poolName"] = pool_name
        isvc_replicas = int(entry.get("replicas", crds.DEFAULT_REPLICAS))
        pools.append(_pool("DecodePool", object_name, namespace, name, "decode", pool_name,
                           pool_spec["protocolVersion"],
                           pool_replicas(isvc_replicas, existing.get(object_name)), pool_spec, isvc_replicas,
                           isvc["metadata"].get("generation")))
    return pools


def stale_decode_pools(isvc: dict, existing_names: list[str]) -> list[str]:
    """DecodePools (by object name) that exist but the InferenceService no longer lists."""
    name, _ = _meta(isvc)
    wanted = {naming.decode_name(name, entry["name"]) for entry in isvc["spec"]["decode"]}
    return sorted(n for n in existing_names if n not in wanted)


def build_network_policies(isvc: dict, config: OperatorConfig) -> list[dict]:
    """NetworkPolicies of an InferenceService.

    Decode pods: the Session (gRPC) and KV-transfer ports (with tensor-parallel decode pools, the ranks'
    receivers' ports after it too: the per-rank push) admit only this service's
    prefill pods. With ``nixl`` the UCX data path uses ports it picks at run time, so every
    port is admitted from those pods. The decode HTTP port (health, metrics) stays open.
    Prefill pods: the HTTP port stays open (the OpenAI door behind its API keys, /metrics);
    the gRPC port (Generate, KV events and load reports, which take no API key) admits only
    this service's router pods when it has a router, and stays open (the clients' gRPC door)
    when ``spec.router.replicas`` is 0. Nothing else is admitted.
    """
    from pdserve.operator import router_workloads  # it imports this module

    name, namespace = _meta(isvc)
    version = protocol_version(isvc, config)
    backend = isvc["spec"].get("transfer", {}).get("backend", crds.DEFAULT_BACKEND)
    same_service_prefill = {"podSelector": {"matchLabels": {naming.LABEL_ISVC: name, naming.LABEL_ROLE: "prefill"}}}
    session_rule: dict = {"from": [same_service_prefill]}  # nixl/UCX: any port, same-service prefill only
    if backend == "tcp":
        kv_rule: dict = {"protocol": "TCP", "port": defaults.KV_TRANSFER_PORT}
        sizes = [parallelism.tensor_size(pool) for pool in isvc["spec"].get("decode", [])] or [1]
        ranks, end = max(sizes), defaults.KV_TRANSFER_PORT
        if ranks > 1:  # rank r's receiver of the per-rank push: KV_TRANSFER_PORT + 1 + r (decode_server/rank_ports.py)
            end += ranks
        if parallelism.tensor_size(isvc["spec"].get("prefill", {})) > min(sizes):  # head slices' receivers after them
            end += defaults.KV_SLICE_PORTS
        if end > defaults.KV_TRANSFER_PORT:
            kv_rule["endPort"] = end
        session_rule["ports"] = [{"protocol": "TCP", "port": defaults.DECODE_GRPC_PORT}, kv_rule]
    grpc_rule: dict = {"ports": [{"protocol": "TCP", "port": defaults.PREFILL_GRPC_PORT}]}
    if router_workloads.router_replicas(isvc) > 0:
        grpc_rule["from"] = [{"podSelector": {"matchLabels": {naming.LABEL_ISVC: name,
                                                              naming.LABEL_ROLE: router_workloads.ROLE}}}]
    policies = []
    for role, ingress in (
        ("decode", [session_rule, {"ports": [{"protocol": "TCP", "port": defaults.DECODE_HTTP_PORT}]}]),
        ("prefill", [{"ports": [{"protocol": "TCP", "port": defaults.HTTP_PORT}]}, grpc_rule]),
    ):
        metadata = {"name": naming.network_policy_name(name, role),
                    "labels": naming.common_labels(name, role, role if role == "prefill" else "all", version)}
        if namespace:
            metadata["namespace"] = namespace
        policies.append({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": metadata,
            "spec": {
                "podSelector": {"matchLabels": {naming.LABEL_ISVC: name, naming.LABEL_ROLE: role}},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        })
    return policies
