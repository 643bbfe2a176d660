"""Why pods do not run, on a real control plane: a pool pod that cannot be scheduled, cannot pull its
image or crashes makes its pool and the InferenceService Degraded with that reason and the
scheduler's or kubelet's words within 60 s, posts a Warning Event on both once per problem, and
clears when the pod becomes ready; `kubectl describe` shows it all.

There is no scheduler or kubelet here: the test writes what they would through the pod's status
subresource (as make_pods_ready does), and binds the pod to the harness's Node object as the
scheduler would. The operator sees only what a real cluster's API server would show it.
"""

import json
import time

import yaml

from harness.conditions import wait_until
from harness.kube_kubelet import FakeKubelet
from harness.operator_harness import condition, get_json, wait_for
from harness.procs import REPO

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
PREFILL = "pdserve.io/inference-service=chat,pdserve.io/role=prefill"
DEGRADED_WITHIN_S = 60  # what the operator promises, from the pod's status to the InferenceService's
NO_GPU = ("0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: 0/1 nodes are available: "
          "1 No preemption victims found for incoming pod.")
PULL_FAILED = ('failed to pull and unpack image "registry.test/pdserve:1": failed to resolve reference '
               '"registry.test/pdserve:1": registry.test/pdserve:1: not found')
CUDA = "RuntimeError: CUDA unavailable: no NVIDIA driver found (--device cuda)"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def report(kube, ns: str, pod: str, status: dict) -> None:
    """Write a pod's status as the scheduler or kubelet would (a merge patch: lists are replaced)."""
    kube.kubectl("patch", "pod", pod, "-n", ns, "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": status}))


def container(state: dict, ready: bool = False, restarts: int = 0, last: dict | None = None) -> dict:
    status = {"name": "prefill", "image": "registry.test/pdserve:1", "imageID": "", "ready": ready, "started": ready,
              "restartCount": restarts, "state": state}
    return {**status, "lastState": last} if last else status


def scheduled(ready: bool) -> list[dict]:
    return [{"type": t, "status": "True" if ready or t in ("PodScheduled", "Initialized") else "False",
             "lastTransitionTime": now()} for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]


def events(kube, ns: str, kind: str, name: str, reason: str) -> list[dict]:
    selector = f"involvedObject.kind={kind},involvedObject.name={name},reason={reason},type=Warning"
    out = kube.kubectl("get", "events", "-n", ns, "--field-selector", selector, "-o", "json").stdout
    return json.loads(out)["items"]


def test_pod_problems_make_the_service_degraded_with_warning_events_and_clear(kube, operator, ns):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["router"] = {"replicas": 0}
    doc["spec"]["decode"] = [{"name": "main", "replicas": 1}]
    kube.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    kube.make_pods_ready(ns, "pdserve.io/pool=main")  # the decode pod runs: only the prefill pod has problems
    pod = wait_for(kube, lambda: (lambda ps: ps[0]["metadata"]["name"] if ps else None)(json.loads(kube.kubectl(
        "get", "pods", "-n", ns, "-l", PREFILL, "-o", "json").stdout)["items"]), "the prefill pod", op=operator)
    took = {}

    def degraded_with(reason: str, words: str, start: float) -> dict:
        """Wait until the InferenceService is Degraded for `reason` with `words` in its message; return it.
        start: time.monotonic() before the pod's status was written."""

        def seen():
            if not operator.alive():
                raise RuntimeError(f"the operator exited:\n{operator.log()[-3000:]}")
            isvc = get_json(kube, "inferenceservice", "chat", "-n", ns)
            cond = condition(isvc, "Degraded") or {}
            return isvc if cond.get("status") == "True" and cond.get("reason") == reason and words in cond.get(
                "message", "") else None
        isvc = wait_until(seen, f"Degraded={reason} with {words!r}", hang_guard_s=DEGRADED_WITHIN_S)
        took.setdefault(reason, round(time.monotonic() - start, 2))
        return isvc

    def warned(reason: str, words: str) -> None:
        for kind, name in (("InferenceService", "chat"), ("PrefillPool", "chat-prefill")):
            wait_until(lambda: [e for e in events(kube, ns, kind, name, reason) if words in e["message"]],
                       f"a Warning Event {reason} on {kind} {name}")

    # 1. The scheduler finds no node with a free GPU.
    start = time.monotonic()
    report(kube, ns, pod, {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                           "message": NO_GPU, "lastTransitionTime": now()}]})
    isvc = degraded_with("Unschedulable", "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.", start)
    assert condition(isvc, "Degraded")["message"].startswith(f"prefill: pod {pod}: 0/1 nodes are available")
    pool = condition(get_json(kube, "prefillpool", "chat-prefill", "-n", ns), "Degraded")
    assert (pool["status"], pool["reason"]) == ("True", "Unschedulable") and NO_GPU in pool["message"]
    warned("Unschedulable", "Insufficient nvidia.com/gpu")

    # 2. Scheduled (bound to the harness's Node: PodScheduled turns True), then the image cannot be pulled;
    #    the kubelet alternates ErrImagePull and ImagePullBackOff: one problem, one Event.
    from kubernetes import client

    with kube.api_client() as api:
        client.CoreV1Api(api).create_namespaced_binding(ns, {
            "apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod},
            "target": {"apiVersion": "v1", "kind": "Node", "name": FakeKubelet.NODE}}, _preload_content=False)
    start = time.monotonic()
    report(kube, ns, pod, {"phase": "Pending", "conditions": scheduled(ready=False), "containerStatuses": [
        container({"waiting": {"reason": "ErrImagePull", "message": PULL_FAILED}})]})
    degraded_with("ImagePullBackOff", PULL_FAILED, start)
    warned("ImagePullBackOff", PULL_FAILED)
    backoff = f'Back-off pulling image "registry.test/pdserve:1": ErrImagePull: {PULL_FAILED}'
    report(kube, ns, pod, {"containerStatuses": [
        container({"waiting": {"reason": "ImagePullBackOff", "message": backoff}})]})
    degraded_with("ImagePullBackOff", "Back-off pulling image", time.monotonic())

    # 3. The image is there, the server crashes at start.
    last = {"terminated": {"exitCode": 1, "reason": "Error", "message": f"Traceback (most recent call last):\n{CUDA}\n",
                           "startedAt": now(), "finishedAt": now()}}
    start = time.monotonic()
    report(kube, ns, pod, {"phase": "Running", "containerStatuses": [container(
        {"waiting": {"reason": "CrashLoopBackOff",
                     "message": f"back-off 40s restarting failed container=prefill pod={pod}"}},
        restarts=3, last=last)]})
    isvc = degraded_with("CrashLoopBackOff", CUDA, start)
    assert 'container "prefill" exited with code 1 (Error)' in condition(isvc, "Degraded")["message"]
    warned("CrashLoopBackOff", CUDA)
    # kopf posts Events in order: the crash's being there, a second one for the image pull would be too.
    for kind, name in (("InferenceService", "chat"), ("PrefillPool", "chat-prefill")):
        assert len(events(kube, ns, kind, name, "ImagePullBackOff")) == 1, "one Event per problem, not per change"
        assert len(events(kube, ns, kind, name, "Unschedulable")) == 1

    described = kube.kubectl("describe", "inferenceservice", "chat", "-n", ns).stdout
    for words in ("Degraded", "CrashLoopBackOff", "CUDA unavailable", "Warning", "Unschedulable", "ImagePullBackOff"):
        assert words in described, described

    # 4. The pod recovers: the conditions clear, and the service serves.
    start = time.monotonic()
    report(kube, ns, pod, {"phase": "Running", "podIP": "10.245.9.9", "podIPs": [{"ip": "10.245.9.9"}],
                           "conditions": scheduled(ready=True), "containerStatuses": [container(
                               {"running": {"startedAt": now()}}, ready=True, restarts=3, last=last)]})

    def serving() -> bool:
        isvc = get_json(kube, "inferenceservice", "chat", "-n", ns)
        return condition(isvc, "Degraded")["status"] == "False" and condition(isvc, "Ready")["status"] == "True"
    wait_until(serving, "Degraded=False and Ready=True once the pod is ready", hang_guard_s=DEGRADED_WITHIN_S)
    took["cleared"] = round(time.monotonic() - start, 2)
    assert condition(get_json(kube, "prefillpool", "chat-prefill", "-n", ns), "Degraded")["status"] == "False"
    print(f"\nseconds from writing the pod's status to the InferenceService's Degraded condition: {took}")
