"""Prefill's view of decodes on a real control plane: what the operator wires up is what the
prefill server's discovery (pdserve.discovery.KubernetesDiscovery) sees, with the prefill
pods' own ServiceAccount token (so their Role is really exercised), and decode pool changes
reach it without a restart.

Pods get IPs and Ready conditions through pods/status (no kubelet here); the
controller-manager's EndpointSlice controller turns them into slices as in any cluster.
"""

import asyncio
import json

from harness.operator_harness import get_json, mark_pods_ready, names, wait_for
from harness.procs import REPO
from pdserve import defaults
from pdserve.discovery import KubernetesDiscovery
from pdserve.protos.version import PROTOCOL_VERSION

OLD, NEW = str(PROTOCOL_VERSION), str(PROTOCOL_VERSION + 1)  # this release's protocol, and an upgrade

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"


def prefill_selector(kube, ns: str) -> str:
    args = get_json(kube, "deployment", "chat-prefill", "-n", ns)["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--decode-selector") + 1]


class Watcher:
    """KubernetesDiscovery running on its own event loop in this thread (start/addresses/stop)."""

    def __init__(self, namespace: str, selector: str, kubeconfig: str):
        self.loop = asyncio.new_event_loop()
        self.discovery = KubernetesDiscovery(namespace=namespace, selector=selector, kubeconfig=kubeconfig, resync_s=20)

    def __enter__(self):
        self.loop.run_until_complete(self.discovery.start())
        return self.discovery

    def __exit__(self, *exc):
        self.loop.run_until_complete(self.discovery.stop())
        self.loop.close()


def test_decode_changes_reach_prefill_discovery_without_restart(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    wait_for(kube, lambda: len(names(kube, "pods", ns, "pdserve.io/inference-service=chat")) == 5, "5 pods",
             op=operator)
    selector = prefill_selector(kube, ns)
    # The prefill pods' ServiceAccount, made by the operator: its Role must be enough to discover.
    token = kube.token_kubeconfig(ns, "chat-prefill")
    port = defaults.DECODE_GRPC_PORT

    with Watcher(ns, selector, str(token)) as discovery:
        assert discovery.addresses() == []  # no decode pod is ready yet
        big = mark_pods_ready(kube, ns, "pdserve.io/pool=big")
        wait_for(kube, lambda: discovery.addresses() == [f"{ip}:{port}" for ip in big], "pool big in discovery")

        main = mark_pods_ready(kube, ns, "pdserve.io/pool=main")
        everyone = sorted(f"{ip}:{port}" for ip in big + main)
        wait_for(kube, lambda: discovery.addresses() == everyone, "pool main joining")

        # A decode pod turning unready leaves the set; scaling a pool away removes its pods.
        mark_pods_ready(kube, ns, "pdserve.io/pool=main", ready=False)
        wait_for(kube, lambda: discovery.addresses() == [f"{ip}:{port}" for ip in big], "main pods unready leaving")
        kube.kubectl("scale", "decodepool", "chat-decode-big", "-n", ns, "--replicas=0")
        wait_for(kube, lambda: discovery.addresses() == [], "pool big scaled to zero", op=operator)


def test_a_protocol_upgrade_keeps_old_prefills_on_old_decodes_until_the_prefills_rolled(kube, operator, ns):
    kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
    wait_for(kube, lambda: len(names(kube, "pods", ns, "pdserve.io/inference-service=chat")) == 5, "5 pods",
             op=operator)
    old_selector = prefill_selector(kube, ns)
    token = kube.token_kubeconfig(ns, "chat-prefill")
    old = {f"{ip}:{defaults.DECODE_GRPC_PORT}" for ip in mark_pods_ready(kube, ns, "pdserve.io/role=decode")}
    retired = "pdserve.io/retired=true"

    with Watcher(ns, old_selector, str(token)) as old_view:
        wait_for(kube, lambda: set(old_view.addresses()) == old and len(old) == 3, f"3 decodes of version {OLD}")
        kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=merge", "-p",
                     json.dumps({"spec": {"protocolVersion": NEW}}))
        new_selector = wait_for(kube, lambda: (lambda s: s if s.endswith(f"protocol-version={NEW}") else None)(
            prefill_selector(kube, ns)), "prefill Deployment on the new version", op=operator)
        assert new_selector != old_selector
        # each decode Service now selects the new version; a copy of it for the old one stays (retired), so an
        # old-version prefill keeps its decodes while they roll, instead of none at once
        wait_for(kube, lambda: len(names(kube, "services", ns, retired)) == 2, "the two retired decode Services",
                 op=operator)
        wait_for(kube, lambda: get_json(kube, "service", "chat-decode-main", "-n", ns)["metadata"]["labels"][
            "pdserve.io/protocol-version"] == NEW, "the main decode Service on the new version", op=operator)
        assert set(old_view.addresses()) == old
        with Watcher(ns, new_selector, str(token)) as new_view:
            wait_for(kube, lambda: names(kube, "pods", ns, f"pdserve.io/protocol-version={NEW},pdserve.io/role=decode"),
                     "new-version decode pods", op=operator)
            new = {f"{ip}:{defaults.DECODE_GRPC_PORT}"
                   for ip in mark_pods_ready(kube, ns, f"pdserve.io/protocol-version={NEW},pdserve.io/role=decode")}
            wait_for(kube, lambda: set(new_view.addresses()) == new,
                     "new-version prefill seeing new-version decodes only")
            assert set(old_view.addresses()) <= old  # never a new one (old ones go as their Deployments roll)
            # the prefill rolls: once no old-version prefill is left, neither are the retired Services
            wait_for(kube, lambda: names(kube, "pods", ns,
                                         f"pdserve.io/protocol-version={NEW},pdserve.io/role=prefill"),
                     "the new-version prefill pod", op=operator)
            mark_pods_ready(kube, ns, f"pdserve.io/protocol-version={NEW},pdserve.io/role=prefill")
            wait_for(kube, lambda: names(kube, "services", ns, retired) == [], "the retired Services deleted",
                     op=operator, timeout=60)
            wait_for(kube, lambda: old_view.addresses() == [], "old-version prefill view empty")
            assert set(new_view.addresses()) == new
