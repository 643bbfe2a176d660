"""Pure builders: an InferenceService -> its router (``pdserve router``, the KV-aware front door).

The router has no pool object of its own: ``spec.router`` (replicas, resources, nodeSelector,
tolerations, loadWeight, the pod settings of ``crd_pod.POD_SETTINGS``, disruptionBudget, rollout) is read
straight from the InferenceService, which owns the objects built here (``build_router``, in
creation order):

- ServiceAccount, Role, RoleBinding ``<isvc>-router``: watch EndpointSlices and read Services
  in the namespace, as ``pdserve.discovery.KubernetesDiscovery`` needs, nothing else;
- Service ``<isvc>-router`` (ClusterIP, port ``http``): the endpoint in the status;
- Deployment ``<isvc>-router``: ``pdserve router --discovery kubernetes --prefill-selector
  <the prefill Service's labels>``, so each router pod follows the prefill Service's
  EndpointSlices (its ready pods, port "grpc") exactly as the prefill follows its decodes;
  it computes nothing (no engine flags, no GPU) but loads the model's tokenizer: for hf:// it
  downloads the config and tokenizer files alone (``fetch-model --tokenizer-only``) into its own
  emptyDir; for a model on a claim (pvc://, ``spec.model.pvcName``) it mounts no claim (it may run
  on any node) and takes the files from a prefill (``--tokenizer-from-prefill``) (model_pods.py);
  with ``spec.auth`` the API keys' Secret mounted read-only and ``--api-key-file`` (the same keys as the
  prefills': a client's key is checked here and again by the prefill it is relayed to); with the
  operator's ``--tls`` its InferenceService's certificate and the ``--tls-*`` flags (``tls_pods.py``);
- PodDisruptionBudget ``<isvc>-router`` (``spec.router.disruptionBudget``, default maxUnavailable 1);
- NetworkPolicy ``<isvc>-router`` when the operator runs with --network-policy: the HTTP
  port open, nothing else (the router only dials out).

``spec.router.replicas: 0`` means no router: ``router_object_names`` lists what the handler
deletes then, and the prefill Service is the front door again. Replicas all watch the same
prefills' KV events and choose alike (``pdserve.router.choice``), so any number may run.
"""

from __future__ import annotations

from pdserve import defaults
from pdserve.operator import crds, naming, pod_settings, pools, tls_pods, workloads
from pdserve.operator.config import OperatorConfig

ROLE = "router"


def router_settings(isvc: dict) -> dict:
    return isvc["spec"].get("router") or {}


def router_replicas(isvc: dict) -> int:
    """Router pods wanted (``spec.router.replicas``, schema default 1); 0: no router."""
    return int(router_settings(isvc).get("replicas", crds.DEFAULT_REPLICAS))


def _facts(isvc: dict, config: OperatorConfig) -> tuple[str, str | None, dict, dict]:
    meta = isvc["metadata"]
    spec = pools.shared_spec(isvc, config, router_settings(isvc))
    return meta["name"], meta.get("namespace"), spec, naming.common_labels(meta["name"], ROLE, ROLE,
                                                                           spec["protocolVersion"])


def router_args(isvc: dict, config: OperatorConfig) -> list[str]:
    """The router command line (after the `pdserve` entry point); flags as `pdserve router --help` names them."""
    name, namespace, spec, _ = _facts(isvc, config)
    model_arg = workloads.model_plan(spec, tokenizer_only=True).model_arg
    args = [
        "router",
        "--host", "0.0.0.0",
        "--port", str(defaults.HTTP_PORT),
        # only its tokenizer is loaded, to hash prompts as the prefill does; /v1/models is the prefill's answer
        *(["--model", model_arg] if model_arg is not None else ["--tokenizer-from-prefill"]),
        "--discovery", "kubernetes",
        "--drain-timeout", str(workloads.DRAIN_TIMEOUT_S),
        "--namespace", namespace or "$(POD_NAMESPACE)",
        "--prefill-selector", naming.prefill_selector(name),
        *workloads.auth_args(isvc["spec"]),  # the prefills' keys: clients' keys go on to them, and the router's own
        *tls_pods.tls_args(spec),  # mutual TLS to the prefills (KV events, load reports)
    ]
    load_weight = router_settings(isvc).get("loadWeight")
    if load_weight is not None:
        args += ["--load-weight", f"{float(load_weight):g}"]
    slo = isvc["spec"].get("slo", {})
    if slo.get("classes"):  # named classes: the global SLO queue lives in the router (router/slo_gate.py)
        args += ["--slo-classes", workloads.slo_json(slo), *workloads.queue_policy_args(isvc["spec"])]
    return args


def build_router_deployment(isvc: dict, config: OperatorConfig) -> dict:
    name, namespace, spec, labels = _facts(isvc, config)
    router = naming.router_name(name)
    volumes, mounts, init_containers = workloads.model_volumes(spec, tokenizer_only=True)
    for extra_volumes, extra_mounts in (workloads.auth_volumes(isvc["spec"]), tls_pods.tls_volumes(spec)):
        volumes, mounts = volumes + extra_volumes, mounts + extra_mounts
    port = defaults.HTTP_PORT
    container = workloads.server_container(
        ROLE, spec, router_args(isvc, config), [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        workloads.pod_env(spec, ROLE, ROLE), mounts, port, startup_failures=60)
    return workloads.server_deployment(
        name=router, namespace=namespace, labels=labels, selector=naming.selector_labels(name, ROLE, ROLE), spec=spec,
        container=container, volumes=volumes, init_containers=init_containers, service_account=router,
        generation=isvc["metadata"].get("generation"), replicas=router_replicas(isvc), http_port=port)


def build_router_service(isvc: dict, config: OperatorConfig) -> dict:
    name, namespace, _, labels = _facts(isvc, config)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": workloads.object_metadata(naming.router_name(name), namespace, labels),
            "spec": {"type": "ClusterIP", "selector": naming.selector_labels(name, ROLE, ROLE),
                     "ports": [{"name": "http", "port": defaults.HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def build_router_disruption_budget(isvc: dict, config: OperatorConfig) -> dict:
    name, namespace, spec, labels = _facts(isvc, config)
    return pod_settings.build_disruption_budget(workloads.object_metadata(naming.router_name(name), namespace, labels),
                                                naming.selector_labels(name, ROLE, ROLE), spec)


def build_router_network_policy(isvc: dict, config: OperatorConfig) -> dict:
    name, namespace, _, labels = _facts(isvc, config)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": workloads.object_metadata(naming.network_policy_name(name, ROLE), namespace, labels),
        "spec": {
            "podSelector": {"matchLabels": {naming.LABEL_ISVC: name, naming.LABEL_ROLE: ROLE}},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"protocol": "TCP", "port": defaults.HTTP_PORT}]}],
        },
    }


def build_router(isvc: dict, config: OperatorConfig) -> list[dict]:
    """Everything the router needs, in creation order (empty when ``spec.router.replicas`` is 0)."""
    if router_replicas(isvc) == 0:
        return []
    name, namespace, _, labels = _facts(isvc, config)
    children = workloads.discovery_rbac(naming.router_name(name), namespace, labels)
    children += [build_router_service(isvc, config), build_router_deployment(isvc, config),
                 build_router_disruption_budget(isvc, config)]
    if config.network_policy:
        children.append(build_router_network_policy(isvc, config))
    return children


def router_object_names(isvc_name: str) -> list[tuple[str, str]]:
    """(kind, name) of every object ``build_router`` can make, in deletion order (the pods go first)."""
    router = naming.router_name(isvc_name)
    return [("Deployment", router), ("PodDisruptionBudget", router), ("Service", router),
            ("NetworkPolicy", naming.network_policy_name(isvc_name, ROLE)), ("RoleBinding", router), ("Role", router),
            ("ServiceAccount", router)]
