"""Pure builders: a PrefillPool / DecodePool -> its Deployment, Service and (prefill) RBAC.

The pods run ``pdserve prefill`` / ``pdserve decode`` with the command lines the servers
define (ports from ``pdserve.defaults``). Pods are labelled with their protocol version;
changing the image or the protocol version changes the pod template, so the Deployment
rolls. The decode Service carries the version label too, and prefill's
``--decode-selector`` includes it, so prefill only ever sees compatible decodes.

Pods run with secure defaults: non-root, no capabilities, no privilege escalation, a
read-only root file system (``/tmp`` is an emptyDir), RuntimeDefault seccomp. A pool's engine
and pod settings (``spec.engine``, env, volumes, scheduling, ...: ``crd_pod.py``) are added by
``pod_settings.py``; each Deployment gets a PodDisruptionBudget. With ``spec.auth`` a prefill pod (and
the router, ``router_workloads.py``) mounts the API keys' Secret read-only and gets ``--api-key-file``
(``auth_volumes``, ``auth_args``). With ``spec.tlsSecret`` (the operator's ``--tls``) every pod mounts its
InferenceService's certificate and passes the ``--tls-*`` flags (``tls_pods.py``).
"""

from __future__ import annotations

import json

from pdserve import defaults
from pdserve.operator import crd_pod, crds, model_pods, naming, pod_settings, tls_pods

RUN_AS_USER = 10001  # the image's `pdserve` user (see Dockerfile)


def _pool_facts(pool: dict) -> tuple[str, str | None, dict, str, str]:
    meta, spec = pool["metadata"], pool["spec"]
    role = "prefill" if pool["kind"] == "PrefillPool" else "decode"
    pool_name = "prefill" if role == "prefill" else spec["poolName"]
    return meta["name"], meta.get("namespace"), spec, role, pool_name


def object_metadata(name: str, namespace: str | None, labels: dict) -> dict:
    """An owned object's metadata: its name, a copy of its labels, its namespace (if any)."""
    metadata = {"name": name, "labels": dict(labels)}
    if namespace:
        metadata["namespace"] = namespace
    return metadata


def pool_labels(pool: dict) -> dict[str, str]:
    _, _, spec, role, pool_name = _pool_facts(pool)
    return naming.common_labels(spec["inferenceService"], role, pool_name, spec["protocolVersion"])


def pool_selector(pool: dict) -> dict[str, str]:
    _, _, spec, role, pool_name = _pool_facts(pool)
    return naming.selector_labels(spec["inferenceService"], role, pool_name)


# A pod that goes (a scale-down, a rolling update) drains: preStop waits PRESTOP_SLEEP_S so that its
# removal from the endpoints reaches prefills, routers and kube-proxy first; then SIGTERM: the
# server stops taking work and gives its requests --drain-timeout to finish: the longest a request
# may run (REQUEST_TIMEOUT_S). The grace period covers both, plus slack to stop.
PRESTOP_SLEEP_S = 5
# The other half of a rolling update: a new pod counts as available (so that an old one may go) only
# after it was Ready this long, so that its endpoint reached the routers and prefills first (discovery,
# then a first load report). Without it a rolling prefill left the routers with no routable prefill for
# a moment: the old one was gone from the endpoints before the new one was routable (503s).
MIN_READY_S = 5
DRAIN_TIMEOUT_S = int(defaults.REQUEST_TIMEOUT_S)
TERMINATION_GRACE_S = PRESTOP_SLEEP_S + DRAIN_TIMEOUT_S + 15
DRAIN_LIFECYCLE = {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}}
BATCH_DB_IN_POD = f"{defaults.BATCH_DATA_MOUNT}/batch.sqlite"  # with spec.batchStorage.pvcName
API_KEYS_VOLUME = "api-keys"  # with spec.auth: its Secret
API_KEY_FILE_IN_POD = f"{defaults.API_KEYS_MOUNT}/{defaults.API_KEYS_FILE}"


def prefill_args(pool: dict) -> list[str]:
    """The prefill command line (after the `pdserve` entry point); flags as `pdserve prefill --help` names them."""
    _, namespace, spec, _, _ = _pool_facts(pool)
    transfer = spec.get("transfer", {})
    return [
        "prefill",
        "--host", "0.0.0.0",
        "--port", str(defaults.HTTP_PORT),
        "--grpc-port", str(defaults.PREFILL_GRPC_PORT),
        *model_args(spec),
        "--discovery", "kubernetes",
        "--namespace", namespace or "$(POD_NAMESPACE)",
        "--decode-selector", naming.decode_selector(spec["inferenceService"], spec["protocolVersion"]),
        "--policy", spec.get("routing", {}).get("policy", crds.DEFAULT_POLICY),
        "--transfer", transfer.get("backend", crds.DEFAULT_BACKEND),
        "--block-size", str(transfer.get("blockSize", defaults.BLOCK_SIZE)),
        "--drain-timeout", str(DRAIN_TIMEOUT_S),
        *(["--batch-db", BATCH_DB_IN_POD] if spec.get("batchStorage", {}).get("pvcName") else []),
        *auth_args(spec),
        *tls_pods.tls_args(spec),
        *queue_policy_args(spec),
        *disaggregation_args(spec),
        *pod_settings.engine_args(spec),
    ]


def disaggregation_args(spec: dict) -> list[str]:
    """--disaggregation from spec.routing.disaggregation (nothing when unset: the server's default, always)."""
    mode = spec.get("routing", {}).get("disaggregation")
    return ["--disaggregation", mode] if mode else []


def queue_policy_args(spec: dict) -> list[str]:
    """--queue-policy from spec.slo.queuePolicy (nothing when unset: the server's default, fifo)."""
    policy = spec.get("slo", {}).get("queuePolicy")
    return ["--queue-policy", policy] if policy else []


def decode_args(pool: dict) -> list[str]:
    """The decode command line (after the `pdserve` entry point); flags as `pdserve decode --help` names them.

    The decode listens on every interface and tells prefill to send KV to its pod IP.
    """
    _, _, spec, _, _ = _pool_facts(pool)
    transfer = spec.get("transfer", {})
    return [
        "decode",
        "--host", "0.0.0.0",
        "--advertise-host", "$(POD_IP)",
        "--port", str(defaults.DECODE_GRPC_PORT),
        "--http-port", str(defaults.DECODE_HTTP_PORT),
        "--kv-port", str(defaults.KV_TRANSFER_PORT),
        *model_args(spec),
        "--transfer", transfer.get("backend", crds.DEFAULT_BACKEND),
        "--block-size", str(transfer.get("blockSize", defaults.BLOCK_SIZE)),
        "--drain-timeout", str(DRAIN_TIMEOUT_S),
        *tls_pods.tls_args(spec),
        *pod_settings.engine_args(spec),
    ]


def model_plan(spec: dict, tokenizer_only: bool = False) -> model_pods.ModelPlan:
    """How a pod gets ``spec.model`` (model_pods.py), with this module's container security."""
    return model_pods.model_plan(spec, container_security(), TERMINATION_MESSAGE_POLICY, tokenizer_only)


def model_args(spec: dict) -> list[str]:
    """--model (the folder the pod reads; hf:// and pvc:// resolved) and --served-model-name."""
    return ["--model", model_plan(spec).model_arg, "--served-model-name", model_pods.served_model_name(spec)]


def _ports(role: str) -> list[dict]:
    if role == "prefill":
        return [{"name": "http", "containerPort": defaults.HTTP_PORT, "protocol": "TCP"},
                {"name": "grpc", "containerPort": defaults.PREFILL_GRPC_PORT, "protocol": "TCP"}]
    return [{"name": "grpc", "containerPort": defaults.DECODE_GRPC_PORT, "protocol": "TCP"},
            {"name": "http", "containerPort": defaults.DECODE_HTTP_PORT, "protocol": "TCP"},
            {"name": "kv", "containerPort": defaults.KV_TRANSFER_PORT, "protocol": "TCP"}]


def pod_env(spec: dict, role: str, pool_name: str) -> list[dict]:
    """Environment of a server pod (spec: a pool spec, or anything with inferenceService and protocolVersion)."""
    env = [
        # the metric labels inference_service and pool (pdserve.metrics reads these)
        {"name": defaults.ENV_INFERENCE_SERVICE, "value": spec["inferenceService"]},
        {"name": defaults.ENV_POOL, "value": pool_name},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "PDSERVE_PROTOCOL_VERSION", "value": spec["protocolVersion"]},
    ]
    if role == "prefill":
        env.append({"name": defaults.ENV_SLO_CLASSES, "value": slo_json(spec.get("slo", {}))})
    return env


def slo_json(slo: dict) -> str:
    """spec.slo as it is, with the default targets (pdserve.slo.classes parses it in the pod); keys
    sorted so that an unchanged SLO never changes the pod template."""
    full = {"ttftMs": crds.DEFAULT_TTFT_MS, "tbtMs": crds.DEFAULT_TBT_MS,
            **{k: v for k, v in slo.items() if k != "queuePolicy"}}  # the policy is a flag, not a class
    return json.dumps(full, sort_keys=True, separators=(",", ":"))


def model_volumes(spec: dict, tokenizer_only: bool = False) -> tuple[list[dict], list[dict], list[dict]]:
    """Volumes, the server container's mounts and the init containers of a pod: /tmp, and what
    ``spec.model`` needs (model_pods.py: a claim read-only; for hf:// the download's cache volume and
    the init container that fills it)."""
    plan = model_plan(spec, tokenizer_only)
    return ([{"name": "tmp", "emptyDir": {}}, *plan.volumes], [{"name": "tmp", "mountPath": "/tmp"}, *plan.mounts],
            plan.init_containers)


def batch_volumes(spec: dict) -> tuple[list[dict], list[dict]]:
    """A prefill's Batch API database volume when ``spec.batchStorage.pvcName`` names one (else the
    database is under HOME=/tmp, the emptyDir)."""
    claim = spec.get("batchStorage", {}).get("pvcName")
    if not claim:
        return [], []
    return ([{"name": "batch", "persistentVolumeClaim": {"claimName": claim}}],
            [{"name": "batch", "mountPath": defaults.BATCH_DATA_MOUNT}])


def auth_args(spec: dict) -> list[str]:
    """--api-key-file where ``auth_volumes`` mounts spec.auth's Secret (nothing without spec.auth)."""
    return ["--api-key-file", API_KEY_FILE_IN_POD] if spec.get("auth") else []


def auth_volumes(spec: dict) -> tuple[list[dict], list[dict]]:
    """The Secret of spec.auth (its one key, as the file API_KEYS_FILE), mounted read-only at API_KEYS_MOUNT, for
    a router or prefill pod; nothing without spec.auth. Readable by the pod's group (fsGroup) only."""
    auth = spec.get("auth")
    if not auth:
        return [], []
    items = [{"key": auth.get("key", defaults.API_KEYS_SECRET_KEY), "path": defaults.API_KEYS_FILE}]
    return ([{"name": API_KEYS_VOLUME, "secret": {"secretName": auth["apiKeySecret"], "items": items,
                                                  "defaultMode": 0o440}}],
            [{"name": API_KEYS_VOLUME, "mountPath": defaults.API_KEYS_MOUNT, "readOnly": True}])


TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"  # the log's end when the container wrote no message


def container_security() -> dict:
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def pod_security() -> dict:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"}}


def server_container(role: str, spec: dict, args: list[str], ports: list[dict], env: list[dict], mounts: list[dict],
                     http_port: int, startup_failures: int) -> dict:
    """The container of a pdserve server pod (prefill, decode, router): its command, probes on
    /ready and /health, security context, drain hook and termination message; the spec's image
    pull policy and resources. The one place a server container is built."""
    container = {
        "name": role,
        "image": spec["image"],
        "command": ["pdserve"],
        "args": args,
        "ports": ports,
        "env": env,
        "volumeMounts": mounts,
        # /ready is 503 while the server cannot serve (a router: no routable prefill): its Service sends it nothing
        "readinessProbe": {"httpGet": {"path": "/ready", "port": http_port}, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": http_port}, "periodSeconds": 10,
                          "failureThreshold": 6, "initialDelaySeconds": 10},
        "startupProbe": {"httpGet": {"path": "/health", "port": http_port}, "periodSeconds": 5,
                         "failureThreshold": startup_failures},
        "securityContext": container_security(),
        # a pod that goes drains first (PRESTOP_SLEEP_S): without the preStop wait it stopped listening
        # while kube-proxy still sent it new connections (refused mid-rollout)
        "lifecycle": DRAIN_LIFECYCLE,
        # a crash at start (e.g. --device cuda without a GPU) puts the end of its log in the container's
        # termination message, which the operator's Degraded condition and Events quote (pod_problems.py)
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    if spec.get("resources"):
        container["resources"] = spec["resources"]
    return container


def server_deployment(*, name: str, namespace: str | None, labels: dict, selector: dict, spec: dict, container: dict,
                      volumes: list[dict], init_containers: list[dict], service_account: str | None,
                      generation: int | None, replicas: int, http_port: int) -> dict:
    """The Deployment of pdserve server pods around ``container``: pod security, service account
    (None: no token mounted), node selector and tolerations from the spec, Prometheus annotations,
    the owner's generation, the pod settings of the spec (pod_settings.py), surge-only rolling updates.
    The one place a server Deployment is built."""
    pod_spec = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": pod_security(),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if service_account is not None:
        pod_spec["serviceAccountName"] = service_account
    pod_spec["automountServiceAccountToken"] = service_account is not None
    for key in ("nodeSelector", "tolerations"):
        if spec.get(key):
            pod_spec[key] = spec[key]
    metadata = object_metadata(name, namespace, labels)
    if generation is not None:
        metadata["annotations"] = {naming.ANNOTATION_OWNER_GENERATION: str(generation)}
    template = {"metadata": {"labels": labels,
                             "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(http_port),
                                             "prometheus.io/path": "/metrics"}},
                "spec": pod_spec}
    pod_settings.apply(template, spec, selector)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {**crd_pod.DEFAULT_ROLLOUT, **(spec.get("rollout") or {})}},
            "minReadySeconds": MIN_READY_S,
            "template": template,
        },
    }


def build_deployment(pool: dict) -> dict:
    """The Deployment of a pool; replicas follow the pool's ``spec.replicas``."""
    name, namespace, spec, role, pool_name = _pool_facts(pool)
    http_port = defaults.HTTP_PORT if role == "prefill" else defaults.DECODE_HTTP_PORT
    volumes, mounts, init_containers = model_volumes(spec)
    if role == "prefill":
        for extra_volumes, extra_mounts in (batch_volumes(spec), auth_volumes(spec)):
            volumes, mounts = volumes + extra_volumes, mounts + extra_mounts
    tls_volumes, tls_mounts = tls_pods.tls_volumes(spec)
    volumes, mounts = volumes + tls_volumes, mounts + tls_mounts
    container = server_container(role, spec, prefill_args(pool) if role == "prefill" else decode_args(pool),
                                 _ports(role), pod_env(spec, role, pool_name), mounts, http_port, startup_failures=120)
    return server_deployment(name=name, namespace=namespace, labels=pool_labels(pool), selector=pool_selector(pool),
                             spec=spec, container=container, volumes=volumes, init_containers=init_containers,
                             service_account=name if role == "prefill" else None,  # prefills read discovery
                             generation=pool["metadata"].get("generation"),
                             replicas=int(spec.get("replicas", crds.DEFAULT_REPLICAS)), http_port=http_port)


def build_service(pool: dict) -> dict:
    """The pool's Service. Prefill: the ClusterIP front door. Decode: headless, one
    address per pod, labelled so its EndpointSlices match prefill's decode selector."""
    name, namespace, _, role, _ = _pool_facts(pool)
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
             for p in _ports(role)]
    spec: dict = {"selector": pool_labels(pool) if role == "decode" else pool_selector(pool), "ports": ports}
    if role == "decode":
        # Select by version too: during a protocol upgrade the slices list only pods of
        # the version the Service (and so the selector prefill uses) is labelled with.
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = False
    else:
        spec["type"] = "ClusterIP"
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_metadata(name, namespace, pool_labels(pool)),
            "spec": spec}


def build_prefill_rbac(pool: dict) -> list[dict]:
    """ServiceAccount, Role and RoleBinding letting prefill pods watch decode EndpointSlices
    (and read Services) in their namespace: nothing else."""
    name, namespace, _, _, _ = _pool_facts(pool)
    return discovery_rbac(name, namespace, pool_labels(pool))


def discovery_rbac(name: str, namespace: str | None, labels: dict) -> list[dict]:
    """ServiceAccount ``name`` and a Role + RoleBinding of the same name: watch EndpointSlices
    and read Services in the namespace (what ``pdserve.discovery.KubernetesDiscovery`` needs)."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_metadata(name, namespace, labels)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": object_metadata(name, namespace, labels),
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]},
                   {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": object_metadata(name, namespace, labels),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace or "default"}]},
    ]


def build_disruption_budget(pool: dict) -> dict:
    """The pool's PodDisruptionBudget (``spec.disruptionBudget``, default maxUnavailable 1)."""
    name, namespace, spec, _, _ = _pool_facts(pool)
    return pod_settings.build_disruption_budget(object_metadata(name, namespace, pool_labels(pool)),
                                                pool_selector(pool), spec)


def build_children(pool: dict) -> list[dict]:
    """Everything a pool owns, in creation order."""
    children = build_prefill_rbac(pool) if pool["kind"] == "PrefillPool" else []
    return [*children, build_service(pool), build_deployment(pool), build_disruption_budget(pool)]
