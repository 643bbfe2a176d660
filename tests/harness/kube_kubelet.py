"""A stand-in for the scheduler and kubelet of one Node, for KubeCluster.make_pods_ready.

The local control plane has neither: this binds chosen pods to a Node that exists only as
an API object, reports them Running and Ready with a pod IP, and confirms their deletion.
"""

from __future__ import annotations

import contextlib
import datetime
import threading

# The pods' IPs: 10.245.0.0/16, an API fact only (nothing listens there). Not the real node's pod
# subnet (kube_node_config.POD_CIDR, 10.244.0.0/24): with both tiers running at once, a fake pod's IP
# once was a real pod's, and a prefill under test reached that pod's decode (1 failure in a busy run).
POD_IP_PREFIX = "10.245."
HOST_IP = POD_IP_PREFIX + "255.1"

class FakeKubelet:
    """The kubelet part of make_pods_ready: one Node object, pods reported running, deletions confirmed.

    A daemon thread polls the pods bound to the node and force-deletes those being deleted
    (a kubelet would stop their containers, then do the same); stop() ends it.
    """

    NODE = "pdserve-test-node"

    def __init__(self, api_client):
        """api_client: an admin kubernetes.client.ApiClient; stop() closes it."""
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(self.api_client)
        self.next_ip = 0
        if not self.core.list_node(field_selector=f"metadata.name={self.NODE}").items:
            self.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.NODE}})
        now = _now()
        self.core.patch_node_status(self.NODE, {"status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "pdserve test harness", "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "capacity": {"cpu": "64", "memory": "256Gi", "pods": "500"},
            "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "500"},
        }})
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._confirm_deletions, name="fake-kubelet", daemon=True)
        self.thread.start()

    def run_pod(self, pod: dict) -> None:
        name, namespace = pod["metadata"]["name"], pod["metadata"]["namespace"]
        if not pod["spec"].get("nodeName"):
            # The binding subresource is what the scheduler uses; the client's Binding model
            # cannot read the response (a Status), hence _preload_content=False.
            self.core.create_namespaced_binding(namespace, {
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.NODE}}, _preload_content=False)
        self.next_ip += 1
        ip = f"{POD_IP_PREFIX}{self.next_ip // 250}.{self.next_ip % 250 + 1}"
        now = _now()
        conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                      for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
        statuses = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": True, "started": True,
                     "restartCount": 0, "state": {"running": {"startedAt": now}}} for c in pod["spec"]["containers"]]
        self.core.patch_namespaced_pod_status(name, namespace, {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}], "startTime": now, "conditions": conditions, "containerStatuses": statuses}})

    def _confirm_deletions(self) -> None:
        from kubernetes.client.rest import ApiException

        while not self.stopping.wait(0.3):
            try:
                for pod in self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.NODE}").items:
                    if pod.metadata.deletion_timestamp is not None:
                        with contextlib.suppress(ApiException):  # already gone
                            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                                            grace_period_seconds=0)
            except Exception:  # the API server is stopping, or a transient error: try again next round
                continue

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        self.api_client.close()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
