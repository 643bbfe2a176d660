import pytest

from procs import ProcessGroup


@pytest.fixture
def procs(tmp_path):
    """A ProcessGroup whose processes are killed after the test; logs go to tmp_path/logs."""
    group = ProcessGroup(log_dir=tmp_path / "logs")
    try:
        yield group
    finally:
        group.close()


@pytest.fixture(scope="session")
def kube(tmp_path_factory):
    """The real Kubernetes control plane (tests/kube.py: etcd, kube-apiserver with RBAC, controller
    manager), started once per session and stopped at its end; a KubeCluster. PDSERVE_KUBECONFIG
    points it at an existing cluster instead. Fails (never skips) with "run make k8s-tools" when
    the binaries are missing."""
    from kube import kube_cluster

    with kube_cluster(tmp_path_factory.mktemp("kube")) as cluster:
        yield cluster


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    # Every test that uses the `kube` fixture is a k8s test, so `-m "not k8s"` leaves it out.
    for item in items:
        if "kube" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.k8s)
