"""The chart's namespaced mode on a real control plane: `operator.watchNamespaces` gives the
operator Roles in those namespaces only, and it works there (and nowhere else) with them."""

import pytest

from harness.operator_harness import CHART, OperatorProcess, get_json, install_chart, names, settled_status, wait_for
from harness.procs import REPO

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
RELEASE, RELEASE_NS, WATCHED, OTHER = "pdns", "pdserve-ns-test", "team-watched", "team-other"


@pytest.fixture
def namespaced_operator(kube, tmp_path):
    # The CRDs are cluster-wide and belong to one release (the suite's, install_chart): this second
    # release installs none of its own (crds.install=false), as a second release in a real cluster would.
    install_chart(kube)
    for ns in (WATCHED, OTHER):
        kube.kubectl("create", "namespace", ns)
    kube.helm("upgrade", "--install", RELEASE, str(CHART), "-n", RELEASE_NS, "--create-namespace",
              "--set", f"operator.watchNamespaces={{{WATCHED}}}", "--set", "networkPolicy.enabled=false",
              "--set", "crds.install=false")
    op = OperatorProcess(kube, tmp_path, scope=("--namespace", WATCHED),
                         service_account=(RELEASE_NS, f"{RELEASE}-pdserve-operator"))
    op.start()
    try:
        yield op
    finally:
        op.stop()
        kube.helm("uninstall", RELEASE, "-n", RELEASE_NS, check=False)
        for ns in (WATCHED, OTHER, RELEASE_NS):
            kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_operator_with_roles_in_one_namespace_reconciles_there_only(kube, namespaced_operator):
    op = namespaced_operator
    # RBAC: Roles (not a ClusterRole) in the watched namespace; nothing in the other one.
    assert get_json(kube, "role", f"{RELEASE}-pdserve-operator", "-n", WATCHED) is not None
    assert get_json(kube, "role", f"{RELEASE}-pdserve-operator", "-n", OTHER) is None
    assert get_json(kube, "clusterrole", f"{RELEASE}-pdserve-operator") is None
    denied = kube.kubectl("get", "deployments", "-n", OTHER, kubeconfig=op.kubeconfig, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()

    kube.kubectl("apply", "-n", WATCHED, "-f", EXAMPLE)
    kube.kubectl("apply", "-n", OTHER, "-f", EXAMPLE)
    wait_for(kube, lambda: (names(kube, "deployments", WATCHED)
                            == ["chat-decode-big", "chat-decode-main", "chat-prefill", "chat-router"]),
             "Deployments in the watched namespace", op=op)
    isvc = settled_status(kube, WATCHED, "0/3", op=op)
    assert isvc["status"]["observedGeneration"] == isvc["metadata"]["generation"]
    assert names(kube, "networkpolicies", WATCHED) == []  # turned off in this release
    assert names(kube, "prefillpools", OTHER) == [] and names(kube, "deployments", OTHER) == []
    # (not a bare "403": log timestamps' milliseconds can read ",403")
    assert "(403)" not in op.log() and "Forbidden" not in op.log(), op.log()[-3000:]
