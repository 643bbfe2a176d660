"""Autoscaling on the real control plane with a real Prometheus: the operator (under the chart's
ServiceAccount, started with --prometheus-url) queries the pools' metrics, and its decisions reach
the pools' scale subresource, hold min/max, appear in status.autoscaling and as Events, and a
scale-down first ranks the pods by load with the pod-deletion cost, so the ReplicaSet removes the
idle pod, not the busy one. With autoscaling off, a `kubectl scale` on a pool is left alone.

Pods do not run here (no kubelet): each "pod" whose metrics Prometheus scrapes is a small
HTTP server in this process serving a real ServerMetrics render, labelled with the pod's name
and namespace as Prometheus' Kubernetes discovery would.
"""

import json
import time

import pytest
import yaml
from aiohttp import web

from harness.operator_harness import OperatorProcess, get_json, install_chart, wait_for
from harness.prometheus import PrometheusServer
from harness.threaded_app import ThreadedApp
from pdserve.metrics import EngineLoad, ServerMetrics
from pdserve.net import free_port

pytestmark = pytest.mark.prometheus

ISVC = "chat"
DECODE = f"{ISVC}-decode-main"
PREFILL = f"{ISVC}-prefill"
ROUND_HANG_GUARD_S = 10  # per autoscaling round (intervalSeconds is 1): a hang guard, not an expectation


@pytest.fixture(scope="module")
def prometheus_port():
    return free_port()


@pytest.fixture(scope="module")
def operator(kube, tmp_path_factory, prometheus_port):
    """The chart, and an operator that reads metrics from the Prometheus each test starts on prometheus_port."""
    install_chart(kube)
    op = OperatorProcess(kube, tmp_path_factory.mktemp("operator"),
                         extra_args=("--prometheus-url", f"http://127.0.0.1:{prometheus_port}"))
    op.start()
    try:
        yield op
    finally:
        op.stop()


class FakePod:
    """/metrics of one pod: a ServerMetrics whose load (KV in use, requests) the test sets."""

    def __init__(self, name: str, role: str, pool: str):
        self.name, self.load = name, {"used": 0, "running": 0}
        self.metrics = ServerMetrics(role, pool=pool, inference_service=ISVC)
        self.metrics.track_load(lambda: EngineLoad(waiting=0, running=self.load["running"], kv_blocks_total=100,
                                                   kv_blocks_free=100 - self.load["used"], block_size=64))
        app = web.Application()
        app.router.add_get("/metrics", self.metrics.aiohttp_handler)
        self.app = ThreadedApp(app)


def isvc(ns: str, decode_replicas: int, decode_max: int, enabled: bool = True, down_s: int = 6) -> str:
    doc = {"apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": ISVC, "namespace": ns},
           "spec": {"model": {"source": "builtin:tiny"}, "router": {"replicas": 0}, "prefill": {"replicas": 1},
                    "decode": [{"name": "main", "replicas": decode_replicas}],
                    "autoscaling": {"enabled": enabled, "decode": {"minReplicas": 1, "maxReplicas": decode_max},
                                    "prefill": {"minReplicas": 1, "maxReplicas": 1}, "intervalSeconds": 1,
                                    "windowSeconds": 5, "scaleDownStabilizationSeconds": down_s, "cooldownSeconds": 2}}}
    return yaml.safe_dump(doc)


def ready_pods(kube, ns: str, selector: str, count: int) -> list[str]:
    return sorted(kube.make_pods_ready(ns, selector, count=count))


def replicas(kube, ns: str, kind: str, name: str) -> int:
    return get_json(kube, kind, name, "-n", ns)["spec"]["replicas"]


def pool_status(kube, ns: str, name: str) -> dict | None:
    auto = (get_json(kube, "inferenceservice", ISVC, "-n", ns).get("status") or {}).get("autoscaling") or {}
    return next((p for p in auto.get("pools", []) if p["name"] == name), None)


def event_reasons(kube, ns: str) -> list[str]:
    out = json.loads(kube.kubectl("get", "events", "-n", ns, "--field-selector",
                                  f"involvedObject.kind=InferenceService,involvedObject.name={ISVC}", "-o",
                                  "json").stdout)
    return [e["reason"] for e in out["items"]]


def last_decision(kube, ns: str) -> str | None:
    auto = (get_json(kube, "inferenceservice", ISVC, "-n", ns).get("status") or {}).get("autoscaling") or {}
    return auto.get("lastDecisionTime")


def wait_for_rounds(kube, ns: str, rounds: int, op) -> None:
    """Until the autoscaler has finished `rounds` more rounds on the InferenceService. Each round writes
    status.autoscaling.lastDecisionTime (whole seconds); rounds are intervalSeconds (1 s) apart, so
    each has its own value: a new value seen is a round done (one missed between two polls only
    makes the wait longer). The timeout is a hang guard: 10x the expected time."""
    seen: set[str] = set()
    first = last_decision(kube, ns)

    def more() -> bool:
        if (now := last_decision(kube, ns)) != first:
            seen.add(now)
        return len(seen) >= rounds
    wait_for(kube, more, f"{rounds} more autoscaling rounds", timeout=ROUND_HANG_GUARD_S * rounds, op=op)


def serve(tmp_path, ns: str, port: int, pods: list[FakePod]) -> PrometheusServer:
    for pod in pods:
        pod.app.__enter__()
    targets = [(pod.name, f"127.0.0.1:{pod.app.port}", {"namespace": ns, "pod": pod.name}) for pod in pods]
    return PrometheusServer(tmp_path / "prometheus", targets, interval=0.5, port=port)


def test_a_full_decode_pool_scales_up_to_its_max_with_status_and_events(kube, operator, ns, tmp_path, prometheus_port):
    kube.kubectl("apply", "-f", "-", input=isvc(ns, decode_replicas=1, decode_max=2))
    (prefill_pod,) = ready_pods(kube, ns, "pdserve.io/role=prefill", 1)
    (decode_pod,) = ready_pods(kube, ns, "pdserve.io/role=decode", 1)
    pods = [FakePod(prefill_pod, "prefill", "prefill"), FakePod(decode_pod, "decode", "main")]
    pods[1].load.update(used=95, running=9)
    try:
        with serve(tmp_path, ns, prometheus_port, pods) as prom:
            prom.wait_for_targets_up(2)
            wait_for(kube, lambda: replicas(kube, ns, "decodepool", DECODE) == 2, "the decode pool scaled to 2",
                     timeout=90, op=operator)
            status = wait_for(kube, lambda: pool_status(kube, ns, DECODE), "status.autoscaling", op=operator)
            assert status["role"] == "decode" and "KV" in (status.get("lastScaleReason") or status["reason"])
            wait_for(kube, lambda: "ScaledUp" in event_reasons(kube, ns), "a ScaledUp Event", op=operator)
            assert get_json(kube, "deployment", DECODE, "-n", ns)["spec"]["replicas"] == 2
            ready_pods(kube, ns, "pdserve.io/role=decode", 2)          # the new decode is up; KV stays full
            wait_for(kube, lambda: "capped at max 2" in (pool_status(kube, ns, DECODE) or {}).get("reason", ""),
                     "the planner at its max", op=operator)
            wait_for_rounds(kube, ns, 5, operator)                     # several more rounds at the max
            assert replicas(kube, ns, "decodepool", DECODE) == 2
            assert replicas(kube, ns, "prefillpool", PREFILL) == 1   # prefill min = max = 1
    finally:
        for pod in pods:
            pod.app.__exit__()


def test_scale_down_marks_the_idle_pod_for_deletion_first(kube, operator, ns, tmp_path, prometheus_port):
    kube.kubectl("apply", "-f", "-", input=isvc(ns, decode_replicas=2, decode_max=2, down_s=8))
    (prefill_pod,) = ready_pods(kube, ns, "pdserve.io/role=prefill", 1)
    idle, busy = ready_pods(kube, ns, "pdserve.io/role=decode", 2)
    # Without a deletion cost the ReplicaSet removes the pod ready for the shortest time first: make
    # that the busy one, so only the cost can save it. The idle pod has been Ready for an hour (its
    # Ready condition says so): the ReplicaSet ranks ready times by powers of two, so seconds apart
    # could tie, an hour cannot.
    an_hour_ago = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
    kube.kubectl("patch", "pod", idle, "-n", ns, "--subresource=status", "--type=strategic", "-p", json.dumps(
        {"status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": an_hour_ago}]}}))
    pods = [FakePod(prefill_pod, "prefill", "prefill"), FakePod(idle, "decode", "main"),
            FakePod(busy, "decode", "main")]
    pods[2].load.update(used=10, running=3)                        # the pool at 5% KV: one decode is plenty
    seen: dict[str, str] = {}
    try:
        with serve(tmp_path, ns, prometheus_port, pods) as prom:
            prom.wait_for_targets_up(3)

            def scaled_down() -> bool:
                for pod in json.loads(kube.kubectl("get", "pods", "-n", ns, "-l", "pdserve.io/role=decode",
                                                   "-o", "json").stdout)["items"]:
                    cost = pod["metadata"].get("annotations", {}).get("controller.kubernetes.io/pod-deletion-cost")
                    if cost is not None:
                        seen[pod["metadata"]["name"]] = cost
                return replicas(kube, ns, "decodepool", DECODE) == 1
            wait_for(kube, scaled_down, "the decode pool scaled to 1", timeout=120, op=operator)
            wait_for(kube, lambda: [p for p in ready_pods(kube, ns, "pdserve.io/role=decode", 1)] == [busy],
                     "the idle decode pod removed, the busy one kept", op=operator)
            scaled_down()
            # ranked by load: the busy pod second (1), so another (the idle one, 0) went first
            assert seen.get(busy) == "1" and seen.get(idle, "0") == "0", seen
            assert "ScaledDown" in event_reasons(kube, ns)
            assert pool_status(kube, ns, DECODE)["desired"] == 1
    finally:
        for pod in pods:
            pod.app.__exit__()


def test_with_autoscaling_off_kubectl_scale_is_left_alone(kube, operator, ns):
    kube.kubectl("apply", "-f", "-", input=isvc(ns, decode_replicas=1, decode_max=2, enabled=False))
    wait_for(kube, lambda: get_json(kube, "decodepool", DECODE, "-n", ns) is not None, "the decode pool", op=operator)
    kube.kubectl("scale", "decodepool", DECODE, "-n", ns, "--replicas=3")     # above autoscaling's max: not applied
    wait_for(kube, lambda: (get_json(kube, "deployment", DECODE, "-n", ns) or {}).get("spec", {}).get("replicas") == 3,
             "the Deployment follows kubectl scale", op=operator)
    # Nothing runs on a timer here (no autoscaler): the operator acts on events. Make it reconcile
    # the InferenceService once more (an annotation is a change kopf hands to the update handler,
    # and an event on which it would start the autoscaler were it on), then look.
    reconciled = f"reconciled {ns}/{ISVC}:"
    wait_for(kube, lambda: operator.log().count(reconciled) >= 1, "the operator's first reconcile", op=operator)
    before = operator.log().count(reconciled)
    kube.kubectl("annotate", "inferenceservice", ISVC, "-n", ns, "test.pdserve.io/touched=1")
    wait_for(kube, lambda: operator.log().count(reconciled) > before, "the operator to reconcile it again", op=operator)
    assert replicas(kube, ns, "decodepool", DECODE) == 3
    assert get_json(kube, "deployment", DECODE, "-n", ns)["spec"]["replicas"] == 3
    assert not (get_json(kube, "inferenceservice", ISVC, "-n", ns).get("status") or {}).get("autoscaling")
    assert not {"ScaledUp", "ScaledDown", "MetricsUnavailable"} & set(event_reasons(kube, ns))


def test_min_above_max_is_refused_by_the_api_server(kube, operator, ns):
    doc = yaml.safe_load(isvc(ns, decode_replicas=1, decode_max=2))
    doc["spec"]["autoscaling"]["decode"] = {"minReplicas": 3, "maxReplicas": 2}
    proc = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0 and "spec.autoscaling.decode.minReplicas must be <= maxReplicas" in proc.stderr
