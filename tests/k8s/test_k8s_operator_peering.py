"""High availability: two operators with kopf peering on a real control plane. Only the
higher-priority one works; when it stops, the other takes over and handles what changed."""

import json

import pytest

from harness.operator_harness import (CHART, RELEASE, RELEASE_NAMESPACE, OperatorProcess, get_json, install_chart,
                                      wait_for)
from harness.procs import REPO

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"


@pytest.fixture
def peering_chart(kube):
    """The chart with peering on (ClusterKopfPeering + RBAC for it); back to the defaults afterwards."""
    install_chart(kube)
    kube.helm("upgrade", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--set", "operator.peering.enabled=true")
    assert get_json(kube, "clusterkopfpeering", "pdserve") is not None
    yield "pdserve"
    kube.helm("upgrade", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE)


def test_standby_operator_takes_over_when_the_active_one_stops(kube, peering_chart, tmp_path):
    ns = "op-peering"
    kube.kubectl("create", "namespace", ns)
    active = OperatorProcess(kube, tmp_path / "active", extra_args=("--peering", peering_chart, "--priority", "100"))
    standby = OperatorProcess(kube, tmp_path / "standby", extra_args=("--peering", peering_chart, "--priority", "10"))
    try:
        active.start()
        # kopf starts paused and resumes once the peering object shows no higher-priority peer.
        wait_for(kube, lambda: "Resuming operations after the pause" in active.log(), "the active operator to work",
                 op=active)
        standby.start()

        def peers():
            status = get_json(kube, "clusterkopfpeering", peering_chart).get("status") or {}
            return {p["priority"] for p in status.values() if isinstance(p, dict)}
        wait_for(kube, lambda: peers() == {100, 10}, "both operators in the peering object", op=standby)
        kube.kubectl("apply", "-n", ns, "-f", EXAMPLE)
        wait_for(kube, lambda: get_json(kube, "deployment", "chat-decode-main", "-n", ns), "Deployments", op=active)
        wait_for(kube, lambda: f"reconciled {ns}/chat" in active.log(), "the active operator's reconcile", op=active)
        assert f"reconciled {ns}/chat" not in standby.log()
        assert "Resuming operations" not in standby.log()  # it stayed paused

        active.stop()  # SIGTERM: kopf withdraws from the peering object
        wait_for(kube, lambda: "Resuming operations after the pause" in standby.log(), "the standby to resume",
                 timeout=90, op=standby)
        kube.kubectl("patch", "pdis", "chat", "-n", ns, "--type=merge", "-p",
                     json.dumps({"spec": {"slo": {"ttftMs": 777}}}))
        wait_for(kube, lambda: get_json(kube, "prefillpool", "chat-prefill", "-n", ns)["spec"]["slo"]["ttftMs"] == 777,
                 "the standby applying the change", timeout=90, op=standby)
        assert f"reconciled {ns}/chat" in standby.log()
    finally:
        active.stop()
        standby.stop()
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)
