"""Status computation: Deployments -> pool conditions -> InferenceService Ready/Progressing/Degraded."""

from pathlib import Path

import yaml

from pdserve.operator import pools, status
from pdserve.operator.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = OperatorConfig(default_image="img:1", protocol_version="1")


def isvc() -> dict:
    doc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    doc["metadata"].update(namespace="ns1", generation=3)
    doc["spec"]["router"] = {"replicas": 0}  # pools only here; the router's part: test_operator_router.py
    return doc


def deployment(replicas: int, ready: int, updated: int | None = None, total: int | None = None, conditions=()) -> dict:
    return {"metadata": {"generation": 2}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": 2, "replicas": replicas if total is None else total, "readyReplicas": ready,
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
    assert conds(status.pool_status(pool, deployment(2, 1, conditions=[stuck]), "s"))["Degraded"][1] == "ProgressDeadlineExceeded"


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
