"""The one-node cluster harness (tests/harness/kube_node.py) itself: a pod really runs (its sandbox
from the locally built pause image, an address on the bridge from the CNI plugin) and kube-proxy
routes its Service to it through iptables.

That the machine is put back afterwards (no process, iptables chain, mount, bridge, cgroup or
changed sysctl left) is checked by node_cluster itself when `node_kube` is torn down: it compares
the machine with how it was before the node started and raises NodeTeardownError otherwise (the
last test of this folder then errors in its teardown).
"""

import ipaddress
import json
import re

import pytest

from harness import kube_node_host as host
from harness.kube_node import machine_state
from harness.kube_node_config import NODE_NAME, POD_CIDR
from harness.kube_node_images import PAUSE_IMAGE

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NAMESPACE = "node-harness"


def _service_rules(ns: str, service: str, cluster_ip: str, pod_ip: str) -> list[str] | None:
    """kube-proxy's two rules for the Service, once both exist: its ClusterIP -> its KUBE-SVC chain, and
    the endpoint's KUBE-SEP chain -> DNAT to the pod; else None."""
    rules = host.iptables_rules("nat")
    front = [r for r in rules if r.startswith("-A KUBE-SERVICES ") and f"-d {cluster_ip}/32" in r
             and re.search(r" -j KUBE-SVC-\S+$", r)]
    dnat = [r for r in rules if r.startswith("-A KUBE-SEP-") and f'"{ns}/{service}' in r
            and f"--to-destination {pod_ip}:80" in r]
    return front + dnat if front and dnat else None


def test_a_pause_pod_runs_on_the_bridge_and_kube_proxy_routes_its_service(node_kube):
    kube = node_kube
    assert kube.node_ip and kube.node_ip != "127.0.0.1"
    kube.kubectl("create", "namespace", NAMESPACE)
    try:
        kube.kubectl("run", "sleeper", "-n", NAMESPACE, f"--image={PAUSE_IMAGE}", "--image-pull-policy=Never",
                     "--port=80")
        kube.kubectl("expose", "pod", "sleeper", "-n", NAMESPACE, "--port=80")
        kube.kubectl("wait", "-n", NAMESPACE, "--for=condition=Ready", "pod/sleeper", "--timeout=120s")
        pod = json.loads(kube.kubectl("get", "pod", "sleeper", "-n", NAMESPACE, "-o", "json").stdout)
        pod_ip = pod["status"]["podIP"]
        assert pod["spec"]["nodeName"] == NODE_NAME
        assert ipaddress.ip_address(pod_ip) in ipaddress.ip_network(POD_CIDR), pod_ip  # the bridge plugin's range
        during = machine_state()
        assert during["bridge"] and during["cgroups"] and during["mounts"], during
        assert during["sysctls"]["net/ipv4/ip_forward"] == "1"
        # kube-proxy programmed the Service: its ClusterIP leads to the pod (the rules name it)
        cluster_ip = kube.cluster_ip(NAMESPACE, "sleeper")
        kube.wait_until(lambda: _service_rules(NAMESPACE, "sleeper", cluster_ip, pod_ip), 60, 0.5,
                        f"kube-proxy's rules for Service {NAMESPACE}/sleeper ({cluster_ip} -> {pod_ip}:80)")
    finally:
        kube.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
