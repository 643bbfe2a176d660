"""Fixtures of the real-Kubernetes tier: the control plane (`kube`), the chart + operator
(`operator`), and a fresh namespace per test (`ns`). Every test here is marked `k8s`."""

import pytest

from harness.operator_harness import OperatorProcess, install_chart


@pytest.fixture(scope="session")
def kube(tmp_path_factory):
    """The real Kubernetes control plane (tests/harness/kube.py: etcd, kube-apiserver with RBAC,
    controller manager), started once per session and stopped at its end; a KubeCluster.
    PDSERVE_KUBECONFIG points it at an existing cluster instead. Fails (never skips) with "run make
    k8s-tools" when the binaries are missing."""
    from harness.kube import kube_cluster

    with kube_cluster(tmp_path_factory.mktemp("kube")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def operator(kube, tmp_path_factory):
    """The chart installed and one operator running under its ServiceAccount; stopped at module end."""
    install_chart(kube)
    op = OperatorProcess(kube, tmp_path_factory.mktemp("operator"), extra_args=("--network-policy",))
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture
def ns(kube, request):
    """A fresh namespace per test, deleted afterwards."""
    name = "op-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)
