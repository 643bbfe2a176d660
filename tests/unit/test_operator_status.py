"""Status computation: Deployments -> pool conditions -> InferenceService Ready/Progressing/Degraded."""

import copy
from pathlib import Path

import yaml

from pdserve.operator import pools, status
from pdserve.operator.config import OperatorConfig
from pdserve.operator.pod_problems import PodProblem

REPO = Path(__file__).resolve().parents[2]
CONFIG = OperatorConfig(default_image="img:1", protocol_version="1")


def isvc() -> dict:
    doc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    doc["metadata"].update(namespace="ns1", generation=3)
    doc["spec"]["router"] = {"replicas": 0}  # pools only here; the router's part: test_operator_router.py
    return doc


def deployment(replicas: int, ready: int, updated: int | None = None, total: int | None = None, conditions=()) -> dict:
    return {"metadata": {"generation": 2}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": 2, "replicas": replicas if total is None else total,
                       "readyReplicas": ready,
                       "updatedReplicas": replicas if updated is None else updated, "conditions": list(conditions)}}


def conds(st: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def test_pool_ready_with_one_ready_pod_and_progressing_until_all_are():
    pool = pools.build_decode_pools(isvc(), CONFIG)[0]  # 2 replicas
    st = status.pool_status(pool, deployment(2, 1), "sel")
    assert conds(st) == {"Ready": ("True", "PodsReady"), "Progressing": ("True", "RollingOut"),
                         "Degraded": ("False", "AsExpected")}
    assert st["readyReplicas"] == 1 and st["replicas"] == 2 and st["selector"] == "sel"
    done = status.pool_status(pool, deployment(2, 2), "sel")
    assert conds(done)["Progressing"] == ("False", "RolloutComplete")


def test_pool_without_deployment_or_pods_is_not_ready():
    pool = pools.build_decode_pools(isvc(), CONFIG)[0]
    assert conds(status.pool_status(pool, None, "s"))["Ready"] == ("False", "DeploymentMissing")
    assert conds(status.pool_status(pool, deployment(2, 0), "s"))["Ready"] == ("False", "NoPodsReady")
    pool["spec"]["replicas"] = 0
    assert conds(status.pool_status(pool, deployment(0, 0), "s"))["Ready"] == ("False", "ScaledToZero")


def test_pool_degraded_on_replica_failure_or_deadline():
    pool = pools.build_decode_pools(isvc(), CONFIG)[0]
    failure = {"type": "ReplicaFailure", "status": "True", "message": "quota exceeded"}
    st = status.pool_status(pool, deployment(2, 0, conditions=[failure]), "s")
    assert conds(st)["Degraded"] == ("True", "ReplicaFailure")
    assert st["conditions"][2]["message"] == "quota exceeded"
    stuck = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "too slow"}
    assert (conds(status.pool_status(pool, deployment(2, 1, conditions=[stuck]), "s"))["Degraded"][1]
            == "ProgressDeadlineExceeded")


def test_old_pods_still_around_mean_progressing():
    pool = pools.build_decode_pools(isvc(), CONFIG)[0]
    assert conds(status.pool_status(pool, deployment(2, 2, updated=1, total=3), "s"))["Progressing"][0] == "True"


def _pools(ready: dict[str, int]):
    svc = isvc()
    prefill = pools.build_prefill_pool(svc, CONFIG)
    decodes = pools.build_decode_pools(svc, CONFIG)
    pst = status.pool_status(prefill, deployment(1, ready["prefill"]), "s")
    dst = [(d, status.pool_status(d, deployment(d["spec"]["replicas"], ready[d["spec"]["poolName"]]), "s"))
           for d in decodes]
    return svc, (prefill, pst), dst


def test_isvc_ready_needs_prefill_and_at_least_one_decode_pool():
    svc, prefill, decodes = _pools({"prefill": 1, "main": 0, "big": 1})
    st = status.isvc_status(svc, prefill, decodes)
    assert conds(st)["Ready"] == ("True", "Serving")
    assert conds(st)["Degraded"] == ("True", "PoolUnavailable")  # main has no ready pod
    assert st["prefillReady"] == "1/1" and st["decodeReady"] == "1/3"
    assert st["endpoint"] == "http://chat-prefill.ns1.svc:8000"
    assert st["observedGeneration"] == 3
    assert [d["name"] for d in st["decode"]] == ["main", "big"]

    svc, prefill, decodes = _pools({"prefill": 0, "main": 2, "big": 1})
    assert conds(status.isvc_status(svc, prefill, decodes))["Ready"] == ("False", "PrefillNotReady")
    svc, prefill, decodes = _pools({"prefill": 1, "main": 0, "big": 0})
    assert conds(status.isvc_status(svc, prefill, decodes))["Ready"] == ("False", "NoDecodePoolReady")


def test_observed_generation_is_the_oldest_generation_the_pools_were_built_from():
    svc, prefill, decodes = _pools({"prefill": 1, "main": 2, "big": 1})
    assert status.isvc_status(svc, prefill, decodes)["observedGeneration"] == 3
    decodes[0][0]["metadata"]["annotations"]["pdserve.io/owner-generation"] = "2"  # main not yet rebuilt
    st = status.isvc_status(svc, prefill, decodes)
    assert st["observedGeneration"] == 2
    assert all(c["observedGeneration"] == 2 for c in st["conditions"])
    assert "observedGeneration" not in status.isvc_status(svc, prefill, decodes[:1])  # a pool is missing
    pool = decodes[0][0]
    pool["metadata"]["generation"] = 5
    dep = deployment(2, 2)
    dep["metadata"]["annotations"] = {"pdserve.io/owner-generation": "4"}  # Deployment built from pool gen 4
    assert status.pool_status(pool, dep, "s")["observedGeneration"] == 4


def test_isvc_with_missing_pools_is_progressing_and_not_ready():
    svc, prefill, decodes = _pools({"prefill": 1, "main": 2, "big": 1})
    st = status.isvc_status(svc, None, decodes[:1])
    assert conds(st)["Ready"] == ("False", "PoolsMissing")
    assert "big" in st["conditions"][0]["message"] and "prefill" in st["conditions"][0]["message"]
    assert conds(st)["Progressing"][0] == "True"
    full = status.isvc_status(svc, prefill, decodes)
    assert conds(full) == {"Ready": ("True", "Serving"), "Progressing": ("False", "Stable"),
                           "Degraded": ("False", "AsExpected")}


def test_transition_time_moves_only_when_status_changes():
    first = status.merge_conditions(None, [status.condition("Ready", False, "NoPodsReady", "", 1)], "T1")
    same = status.merge_conditions(first, [status.condition("Ready", False, "Other", "m", 2)], "T2")
    assert same[0]["lastTransitionTime"] == "T1" and same[0]["reason"] == "Other"
    flipped = status.merge_conditions(same, [status.condition("Ready", True, "PodsReady", "", 2)], "T3")
    assert flipped[0]["lastTransitionTime"] == "T3"


# ---- isvc_status pinned whole, branch by branch (issue 31: its split must not change a field) ----------------

PROBLEM = PodProblem("ImagePullBackOff", "chat-router-7f9", 'container "router" cannot pull image "r:9": not found', ())


def pst(ready: int, rolling: bool = False, degraded: tuple[str, str] | None = None) -> dict:
    """A pool's status as pool_status reports it: ready pods, Progressing, Degraded as (reason, message)."""
    reason, message = degraded or ("AsExpected", "")
    return {"readyReplicas": ready, "conditions": [
        {"type": "Ready", "status": str(ready > 0), "reason": "R", "message": "m"},
        {"type": "Progressing", "status": str(rolling), "reason": "P", "message": "m"},
        {"type": "Degraded", "status": str(degraded is not None), "reason": reason, "message": message}]}


def router_deployment(replicas: int, ready: int, owner: str | None = "3") -> dict:
    dep = deployment(replicas, ready)
    if owner is not None:
        dep["metadata"]["annotations"] = {"pdserve.io/owner-generation": owner}
    return dep


def built(ready: dict[str, int], router: int = 0, **st) -> tuple[dict, tuple, list]:
    """The example InferenceService (generation 3) and its pools, each with pst(ready[pool], **st[pool])."""
    svc = isvc()
    svc["spec"]["router"] = {"replicas": router}
    prefill = pools.build_prefill_pool(svc, CONFIG)
    decodes = pools.build_decode_pools(svc, CONFIG)  # main: 2 replicas, big: 1
    return (svc, (prefill, pst(ready["prefill"], **st.get("prefill", {}))),
            [(d, pst(ready[d["spec"]["poolName"]], **st.get(d["spec"]["poolName"], {}))) for d in decodes])


def summary(name: str, replicas: int, ready: int) -> dict:
    return {"name": name, "replicas": replicas, "readyReplicas": ready, "ready": ready > 0}


def expect(ready: tuple, progressing: tuple, degraded: tuple, *, prefill: tuple, decode: dict, counts: tuple,
           router: tuple | None = None, front: str = "chat-prefill.ns1", gen: int | None = 3,
           protocol: str | None = "1") -> dict:
    """A whole status: conditions as (ok, reason, message); prefill, router, decode pools as (replicas, ready
    pods); counts: prefillReady, decodeReady, routerReady."""
    conditions = [{"type": t, "status": str(ok), "reason": reason, "message": message}
                  for t, (ok, reason, message) in zip(("Ready", "Progressing", "Degraded"),
                                                      (ready, progressing, degraded))]
    st = {"endpoint": f"http://{front}.svc:8000", "prefillReady": counts[0], "decodeReady": counts[1],
          "routerReady": counts[2], "prefill": summary("prefill", *prefill),
          "decode": [summary(n, *d) for n, d in decode.items()],
          "router": summary("router", *router) if router else None,
          "conditions": [c if gen is None else {**c, "observedGeneration": gen} for c in conditions]}
    if protocol:
        st["protocolVersion"] = protocol
    if gen is not None:
        st["observedGeneration"] = gen
    return st


ALL = {"prefill": 1, "main": 2, "big": 1}
SETTLED = (False, "Stable", "all pools settled")
FINE = (False, "AsExpected", "")


def test_pinned_nothing_created_yet_with_a_router_wanted():
    svc, _, _ = built(ALL, router=1)
    assert status.isvc_status(svc, None, []) == expect(
        (False, "PoolsMissing", "pools not created yet: main, big, prefill, router"),
        (True, "PoolsRollingOut", "rolling out or scaling: main, big, prefill, router"), FINE,
        prefill=(0, 0), decode={}, router=(1, 0), counts=("0/0", "0/0", "0/1"), front="chat-router.ns1",
        gen=None, protocol=None)


def test_pinned_pools_without_ready_pods():
    svc, prefill, decodes = built({"prefill": 0, "main": 0, "big": 0}, **{p: {"rolling": True} for p in ALL})
    assert status.isvc_status(svc, prefill, decodes) == expect(
        (False, "PrefillNotReady", "no prefill pod is ready"),
        (True, "PoolsRollingOut", "rolling out or scaling: prefill, main, big"), FINE,
        prefill=(1, 0), decode={"main": (2, 0), "big": (1, 0)}, counts=("0/1", "0/3", None))


def test_pinned_prefill_ready_decodes_not():
    svc, prefill, decodes = built({"prefill": 1, "main": 0, "big": 0}, main={"rolling": True}, big={"rolling": True})
    assert status.isvc_status(svc, prefill, decodes) == expect(
        (False, "NoDecodePoolReady", "no decode pool has a ready pod"),
        (True, "PoolsRollingOut", "rolling out or scaling: main, big"), FINE,
        prefill=(1, 1), decode={"main": (2, 0), "big": (1, 0)}, counts=("1/1", "0/3", None))


def test_pinned_all_ready_without_a_router_ignores_a_leftover_router_deployment():
    svc, prefill, decodes = built(ALL)
    st = status.isvc_status(svc, prefill, decodes)
    assert st == expect((True, "Serving", "prefill ready; decode pools ready: main, big"), SETTLED, FINE,
                        prefill=(1, 1), decode={"main": (2, 2), "big": (1, 1)}, counts=("1/1", "3/3", None))
    assert status.isvc_status(svc, prefill, decodes, router_deployment(1, 1), PROBLEM) == st


def test_pinned_a_pool_without_a_ready_pod_is_unavailable_unless_scaled_to_zero():
    svc, prefill, decodes = built({"prefill": 1, "main": 1, "big": 0})
    assert status.isvc_status(svc, prefill, decodes) == expect(
        (True, "Serving", "prefill ready; decode pools ready: main"), SETTLED,
        (True, "PoolUnavailable", "pools without a ready pod: big"),
        prefill=(1, 1), decode={"main": (2, 1), "big": (1, 0)}, counts=("1/1", "1/3", None))
    decodes[1][0]["spec"]["replicas"] = 0
    assert status.isvc_status(svc, prefill, decodes) == expect(
        (True, "Serving", "prefill ready; decode pools ready: main"), SETTLED, FINE,
        prefill=(1, 1), decode={"main": (2, 1), "big": (0, 0)}, counts=("1/1", "1/2", None))


def test_pinned_a_crashlooping_pool_degrades_the_service():
    crash = ("CrashLoopBackOff", "pod chat-decode-big-1: container exited with 1")
    svc, prefill, decodes = built({"prefill": 1, "main": 2, "big": 0}, big={"rolling": True, "degraded": crash})
    assert status.isvc_status(svc, prefill, decodes) == expect(
        (True, "Serving", "prefill ready; decode pools ready: main"),
        (True, "PoolsRollingOut", "rolling out or scaling: big"),
        (True, "CrashLoopBackOff", "big: pod chat-decode-big-1: container exited with 1"),
        prefill=(1, 1), decode={"main": (2, 2), "big": (1, 0)}, counts=("1/1", "2/3", None))


def test_pinned_the_first_degraded_pool_gives_the_reason_and_every_one_its_message():
    svc, prefill, decodes = built({"prefill": 0, "main": 2, "big": 1},
                                  prefill={"degraded": ("ReplicaFailure", "quota")},
                                  main={"degraded": ("ProgressDeadlineExceeded", "too slow")})
    assert status.isvc_status(svc, prefill, decodes) == expect(
        (False, "PrefillNotReady", "no prefill pod is ready"), SETTLED,
        (True, "ReplicaFailure", "prefill: quota; main: too slow"),
        prefill=(1, 0), decode={"main": (2, 2), "big": (1, 1)}, counts=("0/1", "3/3", None))
    # without a message the reason stands in for it; without a reason, PoolDegraded
    svc, prefill, decodes = built(ALL, main={"degraded": ("Odd", "")}, big={"degraded": ("", "")})
    assert status.isvc_status(svc, prefill, decodes)["conditions"][2] == {
        "type": "Degraded", "status": "True", "reason": "Odd", "message": "main: Odd; big: ", "observedGeneration": 3}
    svc, prefill, decodes = built(ALL, big={"degraded": ("", "")})
    assert status.isvc_status(svc, prefill, decodes)["conditions"][2]["reason"] == "PoolDegraded"


def test_pinned_a_wanted_router_without_its_deployment_is_missing():
    svc, prefill, decodes = built(ALL, router=2)
    assert status.isvc_status(svc, prefill, decodes, None) == expect(
        (False, "PoolsMissing", "pools not created yet: router"),
        (True, "PoolsRollingOut", "rolling out or scaling: router"), FINE,
        prefill=(1, 1), decode={"main": (2, 2), "big": (1, 1)}, router=(2, 0), counts=("1/1", "3/3", "0/2"),
        front="chat-router.ns1", gen=None)


def test_pinned_a_router_without_a_ready_pod_then_ready():
    svc, prefill, decodes = built(ALL, router=2)
    assert status.isvc_status(svc, prefill, decodes, router_deployment(2, 0)) == expect(
        (False, "RouterNotReady", "no router pod is ready (the endpoint is the router)"),
        (True, "PoolsRollingOut", "rolling out or scaling: router"), FINE,
        prefill=(1, 1), decode={"main": (2, 2), "big": (1, 1)}, router=(2, 0), counts=("1/1", "3/3", "0/2"),
        front="chat-router.ns1")
    # observedGeneration: the oldest generation a pool was built from (the router's here)
    assert status.isvc_status(svc, prefill, decodes, router_deployment(2, 2, owner="2")) == expect(
        (True, "Serving", "prefill ready; decode pools ready: main, big; router ready"), SETTLED, FINE,
        prefill=(1, 1), decode={"main": (2, 2), "big": (1, 1)}, router=(2, 2), counts=("1/1", "3/3", "2/2"),
        front="chat-router.ns1", gen=2)


def test_pinned_a_router_pod_problem_comes_after_the_pools():
    svc, prefill, decodes = built(ALL, router=1, prefill={"degraded": ("Unschedulable", "no node")})
    assert status.isvc_status(svc, prefill, decodes, router_deployment(1, 0), PROBLEM) == expect(
        (False, "RouterNotReady", "no router pod is ready (the endpoint is the router)"),
        (True, "PoolsRollingOut", "rolling out or scaling: router"),
        (True, "Unschedulable", f"prefill: no node; router: {PROBLEM.message}"),
        prefill=(1, 1), decode={"main": (2, 2), "big": (1, 1)}, router=(1, 0), counts=("1/1", "3/3", "0/1"),
        front="chat-router.ns1")


def test_pinned_no_observed_generation_while_a_pool_does_not_say_what_it_was_built_from():
    svc, prefill, decodes = built(ALL, router=1)
    del prefill[0]["metadata"]["annotations"]["pdserve.io/owner-generation"]
    assert status.isvc_status(svc, prefill, decodes, router_deployment(1, 1)) == expect(
        (True, "Serving", "prefill ready; decode pools ready: main, big; router ready"), SETTLED, FINE,
        prefill=(1, 1), decode={"main": (2, 2), "big": (1, 1)}, router=(1, 1), counts=("1/1", "3/3", "1/1"),
        front="chat-router.ns1", gen=None)
    prefill[0]["metadata"]["annotations"]["pdserve.io/owner-generation"] = "3"
    assert "observedGeneration" not in status.isvc_status(svc, prefill, decodes, router_deployment(1, 1, owner=None))


def test_pinned_decode_summaries_follow_the_spec_and_an_unwanted_pool_counts_only_in_conditions():
    crash = ("CrashLoopBackOff", "m")
    svc, prefill, decodes = built(ALL, main={"rolling": True}, big={"rolling": True})
    old = copy.deepcopy(decodes[0][0])
    old["spec"]["poolName"] = "old"  # still there, no longer in spec.decode (being deleted)
    given = [(old, pst(1, rolling=True, degraded=crash)), decodes[1], decodes[0]]
    assert status.isvc_status(svc, prefill, given) == expect(
        (True, "Serving", "prefill ready; decode pools ready: main, big"),
        (True, "PoolsRollingOut", "rolling out or scaling: old, big, main"), (True, "CrashLoopBackOff", "old: m"),
        prefill=(1, 1), decode={"main": (2, 2), "big": (1, 1)}, counts=("1/1", "3/3", None))


def test_pinned_default_namespace_and_no_protocol_version():
    svc, prefill, decodes = built(ALL)
    del svc["metadata"]["namespace"]
    prefill[0]["spec"]["protocolVersion"] = ""
    assert status.isvc_status(svc, prefill, decodes) == expect(
        (True, "Serving", "prefill ready; decode pools ready: main, big"), SETTLED, FINE,
        prefill=(1, 1), decode={"main": (2, 2), "big": (1, 1)}, counts=("1/1", "3/3", None),
        front="chat-prefill.default", protocol=None)
