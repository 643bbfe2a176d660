"""The real control plane of tests/harness/kube.py works: RBAC is enforced, controllers run, clients run."""

import json
import uuid

import pytest

from harness import kube as kube_harness
from harness.kube_kubelet import POD_IP_PREFIX

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: NS}
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers: [{name: web, image: registry.invalid/never-pulled:0}]
"""


@pytest.fixture
def namespace(kube):
    """A fresh namespace (with its default ServiceAccount), deleted after the test."""
    name = f"harness-{uuid.uuid4().hex[:8]}"
    kube.kubectl("create", "namespace", name)
    kube.wait_until(lambda: kube.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
                    what=f"ServiceAccount {name}/default")
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false")


def owned(kube, kind: str, namespace: str, owner_kind: str, owner_name: str) -> list[dict]:
    items = json.loads(kube.kubectl("get", kind, "-n", namespace, "-o", "json").stdout)["items"]
    return [i for i in items
            if any(r["kind"] == owner_kind and r["name"] == owner_name
                   for r in i["metadata"].get("ownerReferences", []))]


def test_missing_binaries_fail_with_the_make_target(tmp_path):
    # Not a k8s test: without the binaries the fixture must fail loudly, never skip.
    with pytest.raises(kube_harness.KubeToolsMissing, match="run make k8s-tools"):
        with kube_harness.local_control_plane(tmp_path / "work", bin_dir=tmp_path):
            pass


def test_client_tools_run(kube):
    client = json.loads(kube.kubectl("version", "--client", "-o", "json").stdout)["clientVersion"]
    assert client["major"] == "1" and client["gitVersion"].startswith("v1.")
    assert kube.helm("version", "--short").stdout.startswith("v4.")
    assert kube.kubectl("get", "--raw", "/readyz").stdout == "ok"
    assert kube.server.startswith("https://")


def test_service_account_without_roles_is_forbidden_until_bound(kube, namespace):
    kube.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    token_config = kube.token_kubeconfig(namespace, "reader")

    denied = kube.kubectl("get", "pods", "-n", namespace, kubeconfig=token_config, check=False)
    assert denied.returncode != 0
    assert f'User "system:serviceaccount:{namespace}:reader" cannot list resource "pods"' in denied.stderr

    from kubernetes import client
    from kubernetes.client.rest import ApiException

    with kube.api_client(token_config) as api:
        with pytest.raises(ApiException) as err:
            client.CoreV1Api(api).list_namespaced_pod(namespace)
        assert err.value.status == 403

    kube.kubectl("create", "role", "pod-reader", "--verb=get,list,watch", "--resource=pods", "-n", namespace)
    kube.kubectl("create", "rolebinding", "reader-reads-pods", "--role=pod-reader",
                 f"--serviceaccount={namespace}:reader", "-n", namespace)
    kube.wait_until(
        lambda: kube.kubectl("get", "pods", "-n", namespace, kubeconfig=token_config, check=False).returncode == 0,
        timeout=30, what="the RoleBinding to take effect")
    with kube.api_client(token_config) as api:
        assert client.CoreV1Api(api).list_namespaced_pod(namespace).items == []
        # The Role is namespaced: other namespaces and other verbs stay forbidden.
        with pytest.raises(ApiException) as err:
            client.CoreV1Api(api).list_namespaced_pod("kube-system")
        assert err.value.status == 403
    can_delete = kube.kubectl("auth", "can-i", "delete", "pods", "-n", namespace, kubeconfig=token_config, check=False)
    assert can_delete.stdout.strip() == "no"


def test_deployment_gets_replicaset_and_pods_and_garbage_collection_removes_them(kube, namespace):
    kube.kubectl("apply", "-f", "-", input=DEPLOYMENT.replace("NS", namespace))
    (rs,) = kube.wait_until(lambda: owned(kube, "replicasets", namespace, "Deployment", "web"),
                            what="the deployment controller to create a ReplicaSet")
    rs_name = rs["metadata"]["name"]
    pods = kube.wait_until(lambda: (p := owned(kube, "pods", namespace, "ReplicaSet", rs_name)) and len(p) == 2 and p,
                           what="the replicaset controller to create 2 pods")
    # No scheduler and no kubelet: the pods exist and stay Pending.
    assert {p["status"]["phase"] for p in pods} == {"Pending"}

    kube.kubectl("delete", "deployment", "web", "-n", namespace)
    kube.wait_until(lambda: not owned(kube, "replicasets", namespace, "Deployment", "web")
                    and not kube.kubectl("get", "pods", "-n", namespace, "-o", "name").stdout.strip(),
                    what="the garbage collector to delete the ReplicaSet and its pods")


def test_service_gets_an_endpointslice(kube, namespace):
    kube.kubectl("create", "service", "clusterip", "web", "--tcp=8000:8000", "-n", namespace)
    slices = kube.wait_until(
        lambda: json.loads(kube.kubectl("get", "endpointslices", "-n", namespace, "-l",
                                        "kubernetes.io/service-name=web", "-o", "json").stdout)["items"],
        what="the endpointslice controller to create a slice")
    assert slices[0]["metadata"]["ownerReferences"][0]["kind"] == "Service"


def test_pods_get_the_cluster_ca(kube, namespace):
    # The root CA publisher puts the API server's CA in every namespace (pods mount it with their token).
    ca = kube.wait_until(lambda: kube.kubectl("get", "configmap", "kube-root-ca.crt", "-n", namespace, "-o",
                                              "jsonpath={.data.ca\\.crt}", check=False).stdout,
                         what="ConfigMap kube-root-ca.crt")
    assert ca.startswith("-----BEGIN CERTIFICATE-----")


def test_pods_made_ready_count_in_the_deployment_and_its_endpointslice(kube, namespace):
    kube.kubectl("apply", "-f", "-", input=DEPLOYMENT.replace("NS", namespace))
    kube.kubectl("create", "service", "clusterip", "web", "--tcp=8000:8000", "-n", namespace)
    names = kube.make_pods_ready(namespace, "app=web", count=2)
    assert len(names) == 2

    def ready_replicas():
        status = json.loads(kube.kubectl("get", "deployment", "web", "-n", namespace, "-o", "json").stdout)["status"]
        return status.get("readyReplicas") == 2 and status.get("availableReplicas") == 2

    kube.wait_until(ready_replicas, what="the Deployment to count 2 ready replicas")

    def slice_endpoints() -> list[dict]:
        slices = json.loads(kube.kubectl("get", "endpointslices", "-n", namespace, "-l",
                                         "kubernetes.io/service-name=web", "-o", "json").stdout)["items"]
        return [e for s in slices for e in (s.get("endpoints") or []) if e["conditions"].get("ready")]

    endpoints = kube.wait_until(lambda: (e := slice_endpoints()) and len(e) == 2 and e,
                                what="2 ready endpoints in the Service's EndpointSlice")
    assert {e["targetRef"]["name"] for e in endpoints} == set(names)
    assert all(e["addresses"][0].startswith(POD_IP_PREFIX) for e in endpoints)

    # Scaling down deletes a bound pod; the fake kubelet confirms it, so it really goes away.
    kube.kubectl("scale", "deployment", "web", "--replicas=1", "-n", namespace)
    kube.wait_until(lambda: len(kube.kubectl("get", "pods", "-n", namespace, "-o", "name").stdout.split()) == 1,
                    what="the scaled-down pod to be deleted")
    kube.wait_until(lambda: len(slice_endpoints()) == 1, what="the EndpointSlice to drop the deleted pod")
