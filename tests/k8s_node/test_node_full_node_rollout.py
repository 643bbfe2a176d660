"""A rollout on a node with no spare capacity (issue 48): the pools take every accelerator the node has.

The node advertises 4 of an extended resource, ``example.com/accelerator`` (a node status patch, as a
device plugin reports GPUs; the real kube-scheduler counts it). An InferenceService of `--engine sim`
pods (2 prefills and 2 decodes, each asking for one accelerator; a router asking for none) takes all 4.
While clients stream through the router's Service (short streams, and 600-token ones that span the
drains), with prompts taken in turn from a small set, the pools' pod template changes (a pod annotation
of both pools, ``example.com/revision``: the pools roll, the router, which holds no accelerator, does
not; test_node_rollout.py rolls the router):

1. ``rollout: {maxSurge: 0, maxUnavailable: 1}`` on both pools and revision 1: each pool replaces one
   pod at a time, down then up (the new pod waits, Unschedulable, until the old one has drained and
   gone); the rollout completes: every pool pod replaced, on revision 1, Ready, the InferenceService
   Ready and not Degraded;
2. the trap: ``rollout: {maxSurge: 1, maxUnavailable: 0}`` (the default) and revision 2: each
   pool's surge pod stays Pending (PodScheduled False, Unschedulable, ``Insufficient
   example.com/accelerator``), the InferenceService says so (Degraded, Unschedulable), and every old
   pod stays: nothing can free an accelerator, since maxUnavailable 0 keeps each old pod until a new
   one is available;
3. the way out docs/troubleshooting.md gives ("A stalled rollout"): the pools' rollout set back to
   maxSurge 0 / maxUnavailable 1 on the stalled rollout; it completes as in 1.

No stream is lost or cut (each ends with finish_reason "length", ignore_eos) and none is wrong: the
sim's tokens are a function of the context, so every stream of a prompt has the text it had before
the first rollout, whichever pods served it. Afterwards the new pods hold nothing (KV blocks,
sessions, CacheStore entries, queued requests), the namespace is deleted and the node no longer
advertises the accelerator (also when the test fails).
"""

from __future__ import annotations

import json
import time

import pytest

from harness import node_serving
from harness.node_streams import Streams
from harness.operator_harness import condition, get_json
from harness.pd_cluster import metric, nothing_held, wait_all_released

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

RESOURCE = "example.com/accelerator"
NAMESPACE, ISVC = "full-node", "full"
REPLICAS = 2  # per pool: with maxUnavailable 1, one pod of each serves while the other is replaced
SLOTS = 2 * REPLICAS  # the node's whole supply: one per prefill and decode pod
SHAPE = {"router": 1, "prefill": REPLICAS, "decode": REPLICAS}
DOWN_THEN_UP = {"maxSurge": 0, "maxUnavailable": 1}
SURGE = {"maxSurge": 1, "maxUnavailable": 0}  # the operator's default
PROMPTS = ["a full node", "no room to surge", "down then up"]
SHORT_TOKENS = 24  # Streams' default
LONG_PROMPT, LONG_TOKENS = "a stream across the drains", 600
SELECTOR = f"pdserve.io/inference-service={ISVC}"
REVISION = "example.com/revision"  # a pod annotation of both pools: a new value is a new pod template
ROLL_HANG_GUARD_S = 300  # a rollout of these pools takes about a minute on the 2-core node
READY_HANG_GUARD_S = 300
STALL_HANG_GUARD_S = 120  # the scheduler marks a pod Unschedulable within seconds


def _pool(rollout: dict, revision: str) -> dict:
    return {"replicas": REPLICAS, "rollout": rollout, "engine": {"name": "sim", "simProfile": "cpu-small"},
            "podAnnotations": {REVISION: revision},
            "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {RESOURCE: 1}}}


def _service(rollout: dict, revision: str) -> dict:
    return {
        "apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": ISVC},
        "spec": {"model": {"source": "builtin:tiny"},
                 "router": {"replicas": 1, "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}}},
                 "prefill": _pool(rollout, revision), "decode": [{"name": "main", **_pool(rollout, revision)}]},
    }


def _patch(kube, rollout: dict, revision: str) -> None:
    """Both pools' rollout and revision (the decode list is replaced whole by a merge patch)."""
    spec = {"prefill": {"rollout": rollout, "podAnnotations": {REVISION: revision}},
            "decode": [{"name": "main", **_pool(rollout, revision)}]}
    kube.kubectl("patch", "inferenceservice", ISVC, "-n", NAMESPACE, "--type=merge", "-p", json.dumps({"spec": spec}))


def _revision(pod: dict) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(REVISION)


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _role(pod: dict) -> str:
    return pod["metadata"]["labels"].get("pdserve.io/role", "")


def _rolled_to(kube, revision: str) -> list[dict] | None:
    """The pods once every one is Ready, none is terminating, every pool pod is on `revision`, in SHAPE,
    and the InferenceService has seen its generation, is Ready and not Degraded; else None."""
    pods = kube.pods(NAMESPACE, SELECTOR)
    shape: dict[str, int] = {}
    for p in pods:
        if (p["metadata"].get("deletionTimestamp") or not _ready(p)
                or (_role(p) != "router" and _revision(p) != revision)):
            return None
        shape[_role(p)] = shape.get(_role(p), 0) + 1
    if shape != SHAPE:
        return None
    isvc = get_json(kube, "inferenceservice", ISVC, "-n", NAMESPACE)
    degraded = condition(isvc, "Degraded")
    if (isvc.get("status", {}).get("observedGeneration") != isvc["metadata"]["generation"]
            or not node_serving.isvc_ready(kube, NAMESPACE, ISVC) or (degraded and degraded["status"] == "True")):
        return None
    return pods


def _roll(kube, revision: str, what: str) -> tuple[list[dict], float]:
    t0 = time.monotonic()
    try:
        pods = kube.wait_until(lambda: _rolled_to(kube, revision), ROLL_HANG_GUARD_S, 1, what)
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{node_serving.describe(kube, NAMESPACE)}") from None
    return pods, time.monotonic() - t0


def _accelerators(kube) -> tuple[int, int]:
    """(the node's allocatable accelerators, those the scheduled pods of the namespace hold)."""
    node = json.loads(kube.kubectl("get", "node", kube.node_name, "-o", "json").stdout)
    held = sum(int(c.get("resources", {}).get("limits", {}).get(RESOURCE, 0))
               for p in kube.pods(NAMESPACE, SELECTOR) if p["spec"].get("nodeName")
               and p["status"].get("phase") not in ("Succeeded", "Failed") for c in p["spec"]["containers"])
    return int(node["status"]["allocatable"].get(RESOURCE, 0)), held


def _unschedulable(pod: dict) -> str | None:
    """The scheduler's message when it found no room for `pod` for want of the accelerator."""
    for c in pod["status"].get("conditions", []):
        if (c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable"
                and f"Insufficient {RESOURCE}" in c.get("message", "")):
            return c["message"]
    return None


def _stalled(kube, revision: str) -> list[dict] | None:
    """Each pool's surge pod on `revision`, Pending and Unschedulable for want of the accelerator; else None."""
    pending = [p for p in kube.pods(NAMESPACE, "pdserve.io/role in (prefill,decode)")
               if _revision(p) == revision and _unschedulable(p)]
    return pending if sorted(_role(p) for p in pending) == ["decode", "prefill"] else None


def _isvc_says_unschedulable(kube) -> dict | None:
    cond = condition(get_json(kube, "inferenceservice", ISVC, "-n", NAMESPACE), "Degraded")
    ok = cond and cond["status"] == "True" and cond.get("reason") == "Unschedulable" and RESOURCE in cond["message"]
    return cond if ok else None


def _check_stalled(kube, revision: str, old: set[str]) -> tuple[list[dict], dict]:
    """Phase 2: the surge pods stay Pending, the InferenceService says why, every old pod stays and serves."""
    pending = kube.wait_until(lambda: _stalled(kube, revision), STALL_HANG_GUARD_S, 1,
                              f"each pool's surge pod on revision {revision} Unschedulable ({RESOURCE})")
    cond = kube.wait_until(lambda: _isvc_says_unschedulable(kube), STALL_HANG_GUARD_S, 1,
                           "the InferenceService Degraded, Unschedulable, naming the accelerator")
    # Seen by the operator (a reconcile after the scheduler's verdict), the rollout has not moved: the surge
    # pods are still unplaced and every old pod is still there and Ready: nothing can free an accelerator.
    assert _stalled(kube, revision) and not any(p["spec"].get("nodeName") for p in pending), pending
    pods = {p["metadata"]["name"]: p for p in kube.pods(NAMESPACE, "pdserve.io/role in (prefill,decode)")}
    assert old <= set(pods) and all(_ready(pods[n]) and not pods[n]["metadata"].get("deletionTimestamp")
                                    for n in old), {n: _ready(p) for n, p in pods.items()}
    assert _accelerators(kube) == (SLOTS, SLOTS)

    def deployments_waiting() -> bool:  # each pool's Deployment: its one new pod, and every old one available
        statuses = [get_json(kube, "deployment", f"{ISVC}-{pool}", "-n", NAMESPACE)["status"]
                    for pool in ("prefill", "decode-main")]
        return all(s.get("updatedReplicas") == 1 and s.get("availableReplicas") == REPLICAS
                   and s.get("replicas") == REPLICAS + 1 for s in statuses)

    kube.wait_until(deployments_waiting, STALL_HANG_GUARD_S, 1, "each Deployment waiting on its one surge pod")
    return pending, cond


def _check_texts(refs: dict[str, str], short: Streams, long: Streams) -> None:
    """Every stream of a prompt has that prompt's text: the short ones the text before the rollouts, the
    long ones the first long one's (it completed before the first patch)."""
    wrong = [(p, t) for p, _, t in short.texts if t != refs[p]]
    wrong += [(p, t) for p, _, t in long.texts if t != long.texts[0][2]]
    assert not wrong, wrong[:3]


@pytest.mark.timeout(READY_HANG_GUARD_S + 2 * ROLL_HANG_GUARD_S + 2 * STALL_HANG_GUARD_S + 660)
def test_a_rollout_on_a_full_node_loses_no_stream_and_surge_stalls(node_kube, chart, capsys):
    kube = node_kube
    node_serving.advertise(kube, RESOURCE, SLOTS)
    kube.kubectl("create", "namespace", NAMESPACE)
    try:
        start = time.monotonic()
        kube.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(_service(DOWN_THEN_UP, "0")))
        served = node_serving.wait_served(kube, NAMESPACE, ISVC, start, timeout=READY_HANG_GUARD_S)
        kube.wait_until(lambda: _rolled_to(kube, "0"), READY_HANG_GUARD_S, 1, "every pod Ready")
        assert _accelerators(kube) == (SLOTS, SLOTS)  # the node is full: no room for one more pool pod
        refs = {p: node_serving.stream_chat(served.base_url, served.model, p, max_tokens=SHORT_TOKENS,
                                            ignore_eos=True)[1] for p in PROMPTS}
        marks: dict[str, float] = {}  # when each phase began or ended (time.monotonic()), for the report
        with (Streams(served, loop=2, prompts=PROMPTS) as short,
              Streams(served, loop=2, max_tokens=LONG_TOKENS, prompts=[LONG_PROMPT]) as long):
            short.wait_done(2)
            long.wait_done(1)
            old = {p["metadata"]["name"] for p in kube.pods(NAMESPACE, SELECTOR) if _role(p) != "router"}
            marks["1. maxSurge 0, revision 1"] = time.monotonic()
            _patch(kube, DOWN_THEN_UP, "1")
            at_patch = short.ok
            pods, rolled_s = _roll(kube, "1", "every pool pod on revision 1 (maxSurge 0)")
            marks["rolled"] = time.monotonic()
            assert old.isdisjoint(p["metadata"]["name"] for p in pods)
            assert short.ok > at_patch, (at_patch, short.ok)                        # served during the rollout
            assert _accelerators(kube) == (SLOTS, SLOTS)
            old = {p["metadata"]["name"] for p in pods if _role(p) != "router"}
            marks["2. maxSurge 1, revision 2"] = time.monotonic()
            _patch(kube, SURGE, "2")
            pending, cond = _check_stalled(kube, "2", old)
            during_stall = short.ok
            marks["3. maxSurge 0 on the stalled rollout"] = time.monotonic()
            _patch(kube, DOWN_THEN_UP, "2")
            pods, unstalled_s = _roll(kube, "2", "every pool pod on revision 2 after maxSurge 0 on the stalled rollout")
            marks["rolled again"] = time.monotonic()
            assert old.isdisjoint(p["metadata"]["name"] for p in pods)
            short.wait_done(4)                                                       # the new pods serve
            long.wait_done(1)
        lost = short.errors + long.errors
        t0 = marks["1. maxSurge 0, revision 1"]
        report = (f"full node ({SLOTS} accelerators, {SLOTS} pool pods): maxSurge 0 rollout in {rolled_s:.0f}s; "
                  f"maxSurge 1: surge pods {sorted(p['metadata']['name'] for p in pending)} Unschedulable "
                  f"({_unschedulable(pending[0])!r}), InferenceService {cond['reason']}; back to maxSurge 0: "
                  f"completed in {unstalled_s:.0f}s; streams {short.ok} short ({during_stall} by the stall), "
                  f"{long.ok} of {LONG_TOKENS} tokens, {len(lost)} lost; phases at "
                  f"{ {k: round(v - t0, 1) for k, v in marks.items()} }s")
        with capsys.disabled():
            print("\n" + report)
        when = sorted(round(t - t0, 1) for t in short.error_times + long.error_times)
        assert lost == [], f"{report}; lost at {when}s: {lost[:4]}"
        assert long.ok >= 2 and short.ok >= during_stall + 4, (long.ok, short.ok, during_stall)
        _check_texts(refs, short, long)
        prefills = node_serving.pod_servers(kube, NAMESPACE, "prefill")
        decodes = node_serving.pod_servers(kube, NAMESPACE, "decode")
        assert len(prefills) == len(decodes) == REPLICAS
        assert sum(metric(p.url, "pdserve_requests_total") for p in prefills) > 0   # the new prefills served
        readings = wait_all_released([*prefills, *decodes], timeout=30)
        assert nothing_held(readings), readings
    finally:
        # a hang guard, not an expectation (see test_node_gpu_pool.py)
        kube.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=600s", check=False, timeout=660)
        node_serving.advertise(kube, RESOURCE, None)
    capacity = json.loads(kube.kubectl("get", "node", kube.node_name, "-o", "json").stdout)["status"]["capacity"]
    assert RESOURCE not in capacity, capacity
    assert get_json(kube, "namespace", NAMESPACE) is None
