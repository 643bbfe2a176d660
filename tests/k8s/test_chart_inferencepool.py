"""The chart's InferencePool (Gateway API Inference Extension, docs/gateway.md): off by default; when on,
it selects exactly the router (or prefill) pods the operator makes, on their HTTP port, and names its
endpoint picker; bad values are refused by helm with the value's name; and the real API server, with
the upstream InferencePool CRD installed (tests/k8s/fixtures, v1.6.0), accepts what it renders."""

import json
from pathlib import Path

import pytest
import yaml

from harness.chart import by_kind, render, render_error
from harness.operator_harness import wait_crds_established
from harness.procs import REPO
from pdserve import defaults
from pdserve.operator import pools, router_workloads, workloads
from pdserve.operator.config import OperatorConfig

pytestmark = pytest.mark.k8s
CRD = Path(__file__).parent / "fixtures" / "inferencepool-crd-v1.6.0.yaml"
ON = ("gateway.inferencePool.enabled=true", "gateway.inferencePool.inferenceService=chat",
      "gateway.inferencePool.endpointPicker.service=chat-epp")


def pool(*sets: str) -> dict:
    (inference_pool,) = by_kind(render(*ON, *sets), "InferencePool")
    return inference_pool


def pod_labels(isvc: dict) -> dict[str, dict]:
    """role -> the pod template labels of the Deployments the operator builds for the example."""
    config = OperatorConfig(default_image="i:1", protocol_version="1")
    deployments = {"router": router_workloads.build_router_deployment(isvc, config),
                   "prefill": workloads.build_deployment(pools.build_prefill_pool(isvc, config))}
    for decode in pools.build_decode_pools(isvc, config):
        deployments[f"decode-{decode['spec']['poolName']}"] = workloads.build_deployment(decode)
    return {role: d["spec"]["template"]["metadata"]["labels"] for role, d in deployments.items()}


def test_off_by_default():
    assert not by_kind(render(), "InferencePool")


@pytest.mark.parametrize("target", ["router", "prefill"])
def test_pool_selects_exactly_the_target_pods_on_their_http_port(target):
    p = pool(f"gateway.inferencePool.target={target}")
    assert p["apiVersion"] == "inference.networking.k8s.io/v1"
    assert p["metadata"]["name"] == "chat" and p["metadata"]["namespace"] == "pdserve-system"
    isvc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    isvc["metadata"]["namespace"] = "pdserve-system"
    selector = p["spec"]["selector"]["matchLabels"]
    selected = [role for role, labels in pod_labels(isvc).items() if selector.items() <= labels.items()]
    assert selected == [target]
    assert p["spec"]["targetPorts"] == [{"number": defaults.HTTP_PORT}]
    config = OperatorConfig(default_image="i:1", protocol_version="1")
    container = router_workloads.build_router_deployment(isvc, config)["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "http", "containerPort": defaults.HTTP_PORT, "protocol": "TCP"} in container["ports"]
    assert p["spec"]["endpointPickerRef"] == {"name": "chat-epp", "port": {"number": 9002}, "failureMode": "FailClose"}


def test_name_namespace_and_picker_settings_come_from_values():
    p = pool("gateway.inferencePool.name=chat-pool", "gateway.inferencePool.namespace=team-a",
             "gateway.inferencePool.endpointPicker.port=9100",
             "gateway.inferencePool.endpointPicker.failureMode=FailOpen")
    assert (p["metadata"]["name"], p["metadata"]["namespace"]) == ("chat-pool", "team-a")
    assert p["spec"]["endpointPickerRef"]["port"] == {"number": 9100}
    assert p["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_missing_or_bad_values_are_refused_naming_the_value():
    assert "gateway.inferencePool.inferenceService" in render_error("gateway.inferencePool.enabled=true")
    assert "gateway.inferencePool.endpointPicker.service" in render_error(
        "gateway.inferencePool.enabled=true", "gateway.inferencePool.inferenceService=chat")
    assert "gateway.inferencePool.target must be router or prefill" in render_error(*ON,
                                                                                    "gateway.inferencePool.target=decode")


def test_the_api_server_accepts_the_rendered_pool_with_the_upstream_crd(kube):
    kube.kubectl("apply", "--server-side", "-f", str(CRD))
    wait_crds_established(kube, ["inferencepools.inference.networking.k8s.io"])
    ns = "gateway-pool"
    kube.kubectl("create", "namespace", ns)
    try:
        for target in ("router", "prefill"):
            rendered = pool(f"gateway.inferencePool.target={target}", f"gateway.inferencePool.namespace={ns}",
                            f"gateway.inferencePool.name=chat-{target}")
            kube.wait_until(
                lambda: kube.kubectl("apply", "-f", "-", input=json.dumps(rendered), check=False).returncode == 0,
                timeout=60, what=f"the {target} InferencePool to be accepted (the new CRD serving)")
            stored = json.loads(kube.kubectl("get", "inferencepool", f"chat-{target}", "-n", ns, "-o", "json").stdout)
            assert stored["spec"]["selector"] == rendered["spec"]["selector"]
            assert stored["spec"]["targetPorts"] == [{"number": defaults.HTTP_PORT}]
            assert stored["spec"]["appProtocol"] == "http"  # the CRD's default: plain HTTP/1.1 to the pods
        # the schema is really enforced (a CEL rule of the CRD), so acceptance above means something
        bad = pool(f"gateway.inferencePool.namespace={ns}", "gateway.inferencePool.name=bad")
        bad["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
        proc = kube.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
        assert proc.returncode != 0 and "port number must be unique" in proc.stderr, proc.stderr
    finally:
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)
