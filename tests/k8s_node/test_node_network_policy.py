"""The operator's NetworkPolicies under a CNI that enforces them (tests/harness/kube_node_policy.py: kube-router's
policy controller beside the bridge plugin), with the chart's defaults (networkPolicy.enabled):

- a stranger pod (the pdserve image, no InferenceService labels), in the InferenceService's namespace and in
  another one, connects to every internal port: each decode's gRPC (Session) and KV ports and the prefill's
  gRPC port fail, while the HTTP doors (router, prefill, decode health/metrics) answer the same stranger, and
  every one of those ports answers from this machine (the node, which policies admit): so the listeners are
  there and it is the policy that refuses;
- the InferenceService still serves through them (router -> prefill gRPC, prefill -> decode Session and KV);
- the operator still reconciles: one more decode replica comes up, its prefill reaches it (the new pod is
  admitted by its labels as soon as it runs), a completion streams, and the pool goes back to two.
"""

from __future__ import annotations

import json
import socket

import pytest
import yaml

from harness import node_serving
from harness.pd_cluster import get_json as http_json
from pdserve import defaults

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
CONNECT_TIMEOUT_S = 3.0  # kube-router rejects at once; a dropped SYN would wait this long
STRANGER_NAMESPACE = "strangers"
PROBE = """
import json, os, socket
out = {}
for target in json.loads(os.environ["TARGETS"]):
    ip, port = target.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(float(os.environ["TIMEOUT_S"]))
    try:
        s.connect((ip, int(port)))
        out[target] = "open"
    except socket.timeout:
        out[target] = "timeout"
    except OSError as e:
        out[target] = type(e).__name__
    finally:
        s.close()
print("PROBES " + json.dumps(out))
"""


def connect(target: str) -> str:
    ip, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((ip, int(port)), timeout=CONNECT_TIMEOUT_S):
            return "open"
    except OSError as e:
        return type(e).__name__


def stranger_probes(cluster, namespace: str, name: str, targets: list[str]) -> dict[str, str]:
    """Run a pod with no InferenceService labels that connects to each target once; its results."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace,
                                                         "labels": {"app": "stranger"}},
           "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
                    "containers": [{"name": "probe", "image": cluster.image, "imagePullPolicy": "Never",
                                    "command": ["python", "-c", PROBE],
                                    "env": [{"name": "TARGETS", "value": json.dumps(targets)},
                                            {"name": "TIMEOUT_S", "value": str(CONNECT_TIMEOUT_S)}],
                                    "resources": {"requests": {"cpu": "10m"}}}]}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pod))
    try:
        cluster.wait_until(lambda: cluster.kubectl("get", "pod", name, "-n", namespace, "-o",
                                                   "jsonpath={.status.phase}").stdout in ("Succeeded", "Failed"),
                           120 + CONNECT_TIMEOUT_S * len(targets), 1.0, f"the stranger pod {namespace}/{name}")
        log = cluster.kubectl("logs", name, "-n", namespace).stdout
    finally:
        cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=false", check=False)
    (line,) = [x for x in log.splitlines() if x.startswith("PROBES ")]
    return json.loads(line.removeprefix("PROBES "))


def pod_ips(cluster, ns: str, role: str) -> list[str]:
    return [s.ip for s in node_serving.pod_servers(cluster, ns, role)]


def test_strangers_cannot_reach_the_internal_ports_while_the_service_serves_and_reconciles(node_kube, chat):
    ns = chat.namespace
    policies = json.loads(node_kube.kubectl("get", "networkpolicy", "-n", ns, "-o", "json").stdout)["items"]
    assert sorted(p["metadata"]["name"] for p in policies) == ["chat-decode", "chat-prefill", "chat-router"]
    decodes, (prefill,), (router,) = (pod_ips(node_kube, ns, r) for r in ("decode", "prefill", "router"))
    assert len(decodes) == 3
    internal = [f"{ip}:{port}" for ip in decodes for port in (defaults.DECODE_GRPC_PORT, defaults.KV_TRANSFER_PORT)]
    internal.append(f"{prefill}:{defaults.PREFILL_GRPC_PORT}")
    doors = [f"{router}:{defaults.HTTP_PORT}", f"{prefill}:{defaults.HTTP_PORT}",
             *(f"{ip}:{defaults.DECODE_HTTP_PORT}" for ip in decodes)]
    from_node = {t: connect(t) for t in internal + doors}
    assert set(from_node.values()) == {"open"}, from_node  # every listener is there

    node_kube.kubectl("create", "namespace", STRANGER_NAMESPACE)
    try:
        for namespace in (ns, STRANGER_NAMESPACE):
            seen = stranger_probes(node_kube, namespace, "stranger", internal + doors)
            reached = [t for t in internal if seen[t] == "open"]
            assert not reached, f"a stranger in {namespace} reached internal ports {reached}: {seen}"
            assert all(seen[t] == "open" for t in doors), f"the doors must stay open to it: {seen}"
    finally:
        node_kube.kubectl("delete", "namespace", STRANGER_NAMESPACE, "--wait=false", check=False)

    # the InferenceService's own pods still reach each other (router -> prefill gRPC, prefill -> decodes)
    _, text, finish = node_serving.stream_chat(chat.base_url, chat.model, "Behind policies?", max_tokens=8,
                                               ignore_eos=True)
    assert text and finish == "length"

    # the operator reconciles: a third "main" decode comes up and its prefill reaches it, then back to two
    def scale_main(replicas: int) -> None:
        doc = json.loads(node_kube.kubectl("get", "pdis", "chat", "-n", ns, "-o", "json").stdout)
        pools = [dict(p, replicas=replicas) if p["name"] == "main" else p for p in doc["spec"]["decode"]]
        node_kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=merge", "-p",
                          json.dumps({"spec": {"decode": pools}}))

    scale_main(3)
    try:
        node_kube.wait_until(lambda: len(pod_ips(node_kube, ns, "decode")) == 4, node_serving.READY_TIMEOUT_S, 1.0,
                             "a fourth decode pod Ready")
        (prefill_server,) = node_serving.pod_servers(node_kube, ns, "prefill")

        def routable() -> bool:
            found = http_json(prefill_server.url + "/health")[1]["routable_decodes"]
            return sorted(a.rsplit(":", 1)[0] for a in found) == sorted(pod_ips(node_kube, ns, "decode"))
        node_kube.wait_until(routable, 60, 1.0, "the prefill to reach all four decodes")
        _, text, finish = node_serving.stream_chat(chat.base_url, chat.model, "Four decodes?", max_tokens=8,
                                                   ignore_eos=True)
        assert text and finish == "length"
    finally:
        scale_main(2)
    node_kube.wait_until(lambda: len(pod_ips(node_kube, ns, "decode")) == 3, 180, 1.0, "back to three decode pods")
