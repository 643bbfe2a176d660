"""The router the operator gives an InferenceService, on a real control plane: its Deployment,
Service, RBAC and NetworkPolicy, owned by the InferenceService; the status endpoint pointing at
it; replicas following spec.router.replicas, 0 removing it all (the prefill is the front door
again); and a real `pdserve router` process, with the router pods' own ServiceAccount token,
finding the prefill pods through the prefill Service's EndpointSlices as the pods would.

Pods never run here (no kubelet): the harness reports them ready with 10.245.x.y IPs, so the
router sees the prefill addresses but cannot reach them (none is routable, /ready is 503).
"""

import json

from harness.operator_harness import condition, get_json, mark_pods_ready, names, wait_for
from harness.pd_cluster import get_json as http_json
from harness.procs import REPO, wait_for_port
from pdserve import defaults
from pdserve.net import free_port

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
ROUTER_KINDS = ("deployments", "services", "serviceaccounts", "roles", "rolebindings", "networkpolicies")


def router_objects(kube, ns: str) -> dict[str, bool]:
    return {kind: "chat-router" in names(kube, kind, ns) for kind in ROUTER_KINDS}


def isvc_status(kube, ns: str) -> dict:
    return (get_json(kube, "inferenceservice", "chat", "-n", ns) or {}).get("status") or {}


def set_router_replicas(kube, ns: str, replicas: int) -> None:
    kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=merge", "-p",
                 json.dumps({"spec": {"router": {"replicas": replicas}}}))


def test_router_objects_status_endpoint_and_replicas_follow_spec_router(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    wait_for(kube, lambda: all(router_objects(kube, ns).values()), "the router's objects", op=operator)
    isvc = get_json(kube, "inferenceservice", "chat", "-n", ns)
    for kind in ROUTER_KINDS:
        owners = get_json(kube, kind, "chat-router", "-n", ns)["metadata"]["ownerReferences"]
        assert [(o["kind"], o["name"], o["uid"], o.get("controller")) for o in owners] == [
            ("InferenceService", "chat", isvc["metadata"]["uid"], True)], kind
    service = get_json(kube, "service", "chat-router", "-n", ns)
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["ports"][0]["port"] == defaults.HTTP_PORT
    deployment = get_json(kube, "deployment", "chat-router", "-n", ns)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "chat-router"

    st = wait_for(kube, lambda: (lambda s: s if s.get("routerReady") == "0/1" else None)(isvc_status(kube, ns)),
                  "router in the status", op=operator)
    assert st["endpoint"] == f"http://chat-router.{ns}.svc:{defaults.HTTP_PORT}"
    assert "ROUTER" in kube.kubectl("get", "pdis", "chat", "-n", ns, "-o", "wide").stdout  # the printer column

    # Serving needs a ready router pod too: the endpoint is the router.
    mark_pods_ready(kube, ns, "pdserve.io/inference-service=chat,pdserve.io/role=prefill")
    mark_pods_ready(kube, ns, "pdserve.io/pool=big")
    wait_for(kube, lambda: condition(get_json(kube, "pdis", "chat", "-n", ns), "Ready")["reason"] == "RouterNotReady",
             "Ready=False/RouterNotReady", op=operator)
    mark_pods_ready(kube, ns, "pdserve.io/role=router")
    wait_for(kube, lambda: condition(get_json(kube, "pdis", "chat", "-n", ns), "Ready")["status"] == "True",
             "Ready=True with a ready router", op=operator)

    set_router_replicas(kube, ns, 3)
    wait_for(kube, lambda: get_json(kube, "deployment", "chat-router", "-n", ns)["spec"]["replicas"] == 3,
             "the router Deployment scaled to 3", op=operator)
    wait_for(kube, lambda: isvc_status(kube, ns).get("routerReady", "").endswith("/3"), "routerReady x/3", op=operator)

    set_router_replicas(kube, ns, 0)
    wait_for(kube, lambda: not any(router_objects(kube, ns).values()), "every router object deleted", op=operator)
    st = wait_for(kube, lambda: (lambda s: s if "routerReady" not in s else None)(isvc_status(kube, ns)),
                  "router fields leaving the status", op=operator)
    assert st["endpoint"] == f"http://chat-prefill.{ns}.svc:{defaults.HTTP_PORT}" and "router" not in st
    assert condition(get_json(kube, "pdis", "chat", "-n", ns), "Ready")["status"] == "True"  # prefill + decode serve
    wait_for(kube, lambda: names(kube, "pods", ns, "pdserve.io/role=router") == [], "router pods gone", op=operator)

    set_router_replicas(kube, ns, 1)
    wait_for(kube, lambda: all(router_objects(kube, ns).values()), "the router back", op=operator)


def test_a_router_process_with_the_router_pods_token_discovers_the_prefill_pods(kube, operator, ns, procs):
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    wait_for(kube, lambda: get_json(kube, "deployment", "chat-router", "-n", ns), "router Deployment", op=operator)
    args = get_json(kube, "deployment", "chat-router", "-n", ns)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "router"
    flags = dict(zip(args[1::2], args[2::2]))
    token = kube.token_kubeconfig(ns, "chat-router")  # what the router pods get: its Role is really exercised
    port = free_port()
    router = procs.pdserve("router", "--port", str(port), "--model", flags["--model"],
                           "--discovery", flags["--discovery"], "--namespace", flags["--namespace"],
                           "--prefill-selector", flags["--prefill-selector"], "--kubeconfig", str(token),
                           name="router-k8s")
    wait_for_port(port, proc=router, timeout=120)
    url = f"http://127.0.0.1:{port}"

    def prefills() -> list[str]:
        return sorted(http_json(url + "/health")[1]["prefills"])

    assert prefills() == []  # no prefill pod is ready yet
    first = mark_pods_ready(kube, ns, "pdserve.io/role=prefill")
    wait_for(kube, lambda: prefills() == [f"{ip}:{defaults.PREFILL_GRPC_PORT}" for ip in first], "the prefill pod")
    kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=merge", "-p", '{"spec": {"prefill": {"replicas": 2}}}')
    wait_for(kube, lambda: len(names(kube, "pods", ns, "pdserve.io/role=prefill")) == 2, "a second prefill pod",
             op=operator)
    both = mark_pods_ready(kube, ns, "pdserve.io/role=prefill")
    wait_for(kube, lambda: prefills() == sorted(f"{ip}:{defaults.PREFILL_GRPC_PORT}" for ip in both),
             "both prefill pods in the router")
    # an unready prefill pod leaves the router's set (and so its index) at once
    mark_pods_ready(kube, ns, "pdserve.io/role=prefill", ready=False)
    wait_for(kube, lambda: prefills() == [], "unready prefill pods leaving the router")
    status, body = http_json(url + "/ready")
    assert status == 503 and body["ready"] is False
    assert router.poll() is None
    log = (procs.log_dir / "router-k8s.log").read_text(errors="replace")
    assert "Forbidden" not in log and "(403)" not in log, log[-3000:]
