"""Kubernetes discovery against the real control plane: decode Services selected by label,
their EndpointSlices (filled by the real endpointslice controller from ready pods) followed
by a watch; and a prefill process in --discovery kubernetes mode sees those decodes."""

import asyncio
import time


from harness.kube_kubelet import POD_IP_PREFIX
from harness.pd_cluster import get_json
from pdserve.net import free_port
from harness.procs import wait_for_port

NS = "pdserve-disc"
MANIFEST = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: decode-a, namespace: %(ns)s}
spec:
  replicas: 2
  selector: {matchLabels: {app: decode-a}}
  template:
    metadata: {labels: {app: decode-a}}
    spec: {containers: [{name: decode, image: pdserve:test}]}
---
apiVersion: v1
kind: Service
metadata: {name: decode-a, namespace: %(ns)s, labels: {pdserve.io/role: decode}}
spec:
  selector: {app: decode-a}
  ports: [{name: grpc, port: 50052, targetPort: 50052}, {name: http, port: 8001, targetPort: 8001}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: other, namespace: %(ns)s}
spec:
  replicas: 1
  selector: {matchLabels: {app: other}}
  template:
    metadata: {labels: {app: other}}
    spec: {containers: [{name: other, image: pdserve:test}]}
---
apiVersion: v1
kind: Service
metadata: {name: other, namespace: %(ns)s, labels: {pdserve.io/role: prefill}}
spec:
  selector: {app: other}
  ports: [{name: grpc, port: 50052, targetPort: 50052}]
"""


def _wait(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def test_endpointslice_watch_follows_selected_decode_services(kube, tmp_path, procs):
    from pdserve.discovery import KubernetesDiscovery

    manifest = tmp_path / "m.yaml"
    manifest.write_text(MANIFEST % {"ns": NS})
    kube.kubectl("create", "namespace", NS)
    kube.kubectl("apply", "-f", str(manifest))
    kube.make_pods_ready(NS, "app=decode-a", count=2)
    kube.make_pods_ready(NS, "app=other", count=1)

    async def scenario():
        disc = KubernetesDiscovery(NS, "pdserve.io/role=decode", kubeconfig=str(kube.kubeconfig))
        await disc.start()
        try:
            two = await asyncio.to_thread(_wait, lambda: len(disc.addresses()) == 2 and disc.addresses(), 30,
                                          "2 decode endpoints")
            assert all(a.startswith(POD_IP_PREFIX) and a.endswith(":50052") for a in two), two
            kube.kubectl("scale", "deployment/decode-a", "-n", NS, "--replicas=3")
            await asyncio.to_thread(kube.make_pods_ready, NS, "app=decode-a", 3)
            three = await asyncio.to_thread(_wait, lambda: len(disc.addresses()) == 3 and disc.addresses(), 30,
                                            "3 endpoints")
            assert set(two) < set(three)
            kube.kubectl("label", "service/decode-a", "-n", NS, "pdserve.io/role=retired", "--overwrite")
            await asyncio.to_thread(_wait, lambda: disc.addresses() == [], 30, "the unselected service to drop out")
            kube.kubectl("label", "service/decode-a", "-n", NS, "pdserve.io/role=decode", "--overwrite")
            await asyncio.to_thread(_wait, lambda: len(disc.addresses()) == 3, 30, "the service to come back")
        finally:
            await disc.stop()

    asyncio.run(scenario())

    # a prefill process in kubernetes mode discovers them (pod IPs are API objects only:
    # no load report ever comes back, so it is not ready and says why)
    http_port = free_port()
    prefill = procs.pdserve("prefill", "--port", str(http_port), "--grpc-port", str(free_port()), "--discovery",
                            "kubernetes",
                            "--decode-selector", "pdserve.io/role=decode", "--namespace", NS, "--kubeconfig",
                            str(kube.kubeconfig), "--model", "tiny", "--threads", "1", name="prefill-k8s")
    wait_for_port(http_port, proc=prefill, timeout=120)
    url = f"http://127.0.0.1:{http_port}"
    health = _wait(lambda: len(get_json(url + "/health")[1]["decodes"]) == 3 and get_json(url + "/health")[1], 30,
                   "prefill discovery")
    assert all(a.endswith(":50052") for a in health["decodes"])
    status, body = get_json(url + "/ready")
    assert status == 503 and body["ready"] is False
