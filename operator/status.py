"""Pure status computation: Deployments -> pool status -> InferenceService status.

Conditions (each with a reason and a message):

* Ready: a pool is Ready when at least one of its pods is ready; an InferenceService is
  Ready only when its prefill pool is Ready, at least one decode pool is, and (with a
  router, ``spec.router.replicas`` > 0) a router pod is: the endpoint is then the router.
* Progressing: a rollout or scale is under way (pods not yet updated/ready/removed).
* Degraded: something is wrong that waiting will not fix by itself. A pool's reason, first
  that applies: ``ReplicaFailure`` (its ReplicaSet cannot create pods), a problem of its pods
  (``pod_problems.REASONS``: ImagePullBackOff, CreateContainerError, InitContainerFailed,
  CrashLoopBackOff, Unschedulable, with the kubelet's or scheduler's message), then
  ``ProgressDeadlineExceeded`` (the Deployment's rollout deadline passed). An InferenceService
  takes the reason of its first degraded pool (prefill, then decode pools, then router) and
  lists every degraded pool's message; ``PoolUnavailable`` when it is Ready but a pool that
  should serve has no ready pod. docs/troubleshooting.md: what each reason means, how to fix it.

``lastTransitionTime`` changes only when a condition's status changes.
"""

from __future__ import annotations

import datetime

from pdserve import defaults
from pdserve.operator import naming, router_workloads
from pdserve.operator.pod_problems import PodProblem


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool, reason: str, message: str, generation: int | None) -> dict:
    cond = {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def merge_conditions(old: list[dict] | None, new: list[dict], timestamp: str) -> list[dict]:
    """New conditions, keeping each old lastTransitionTime whose status did not change."""
    previous = {c.get("type"): c for c in old or []}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"] and before.get("lastTransitionTime")
        merged.append({**cond, "lastTransitionTime": before["lastTransitionTime"] if same else timestamp})
    return merged


def _deployment_condition(deployment: dict, type_: str) -> dict | None:
    for cond in deployment.get("status", {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


def pool_status(pool: dict, deployment: dict | None, selector: str, problem: PodProblem | None = None) -> dict:
    """The status of a pool (without lastTransitionTime; see merge_conditions).

    observedGeneration is the pool generation its Deployment was last built from; problem: the
    worst problem of the pool's pods (pod_problems.pool_problem), or None.
    """
    generation = naming.owner_generation(deployment)
    desired = int(pool["spec"].get("replicas", 1))
    if deployment is None:
        return {
            "observedGeneration": generation, "replicas": 0, "readyReplicas": 0, "updatedReplicas": 0,
            "selector": selector,
            "conditions": [
                condition("Ready", False, "DeploymentMissing", "the pool's Deployment does not exist yet", generation),
                condition("Progressing", True, "Creating", "creating the pool's Deployment", generation),
                condition("Degraded", False, "AsExpected", "", generation),
            ],
        }
    dstatus = deployment.get("status", {}) or {}
    total = int(dstatus.get("replicas") or 0)
    ready = int(dstatus.get("readyReplicas") or 0)
    updated = int(dstatus.get("updatedReplicas") or 0)
    counts = f"{ready}/{desired} pods ready, {updated}/{desired} updated, {total} in all"
    dep_generation = deployment.get("metadata", {}).get("generation", 0)
    dep_observed = dstatus.get("observedGeneration", 0)
    dep_desired = deployment.get("spec", {}).get("replicas", desired)

    if ready >= 1:
        ready_cond = condition("Ready", True, "PodsReady", counts, generation)
    elif desired == 0:
        ready_cond = condition("Ready", False, "ScaledToZero", "the pool has 0 replicas", generation)
    else:
        ready_cond = condition("Ready", False, "NoPodsReady", counts, generation)

    rolling = (dep_observed < dep_generation or dep_desired != desired or updated < desired
               or ready < desired or total > desired)
    progressing = condition("Progressing", rolling, "RollingOut" if rolling else "RolloutComplete", counts, generation)

    failure = _deployment_condition(deployment, "ReplicaFailure")
    dep_progress = _deployment_condition(deployment, "Progressing")
    if failure is not None and failure.get("status") == "True":
        degraded = condition("Degraded", True, "ReplicaFailure", failure.get("message", ""), generation)
    elif problem is not None:
        degraded = condition("Degraded", True, problem.reason, problem.message, generation)
    elif dep_progress is not None and dep_progress.get("reason") == "ProgressDeadlineExceeded":
        degraded = condition("Degraded", True, "ProgressDeadlineExceeded", dep_progress.get("message", ""), generation)
    else:
        degraded = condition("Degraded", False, "AsExpected", counts, generation)
    return {"observedGeneration": generation, "replicas": total, "readyReplicas": ready, "updatedReplicas": updated,
            "selector": selector, "conditions": [ready_cond, progressing, degraded]}


def _condition(status: dict | None, type_: str) -> dict:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return {}


def _is_true(status: dict | None, type_: str) -> bool:
    return _condition(status, type_).get("status") == "True"


def _summary(name: str, pool: dict, status: dict | None) -> dict:
    return {"name": name, "replicas": int(pool["spec"].get("replicas", 1)),
            "readyReplicas": int((status or {}).get("readyReplicas", 0)), "ready": _is_true(status, "Ready")}


def router_status(isvc: dict, deployment: dict | None, problem: PodProblem | None = None) -> tuple[dict, dict] | None:
    """(a pool-like view of the router, its status as pool_status computes it), or None without a router.

    The view has the wanted replicas as ``spec.replicas`` and the Deployment's metadata (so its
    owner generation counts towards observedGeneration); metadata is empty while it is missing.
    """
    wanted = router_workloads.router_replicas(isvc)
    if wanted == 0:
        return None
    view = {"metadata": (deployment or {}).get("metadata", {}), "spec": {"replicas": wanted}}
    return view, pool_status(view, deployment, naming.label_selector(
        naming.selector_labels(isvc["metadata"]["name"], router_workloads.ROLE, router_workloads.ROLE)), problem)


def isvc_status(isvc: dict, prefill: tuple[dict, dict] | None, decodes: list[tuple[dict, dict]],
                router_deployment: dict | None = None, router_problem: PodProblem | None = None) -> dict:
    """The status of an InferenceService from its pools and their (freshly computed) statuses.

    prefill: (PrefillPool, its status) or None when the pool does not exist yet;
    decodes: (DecodePool, its status) for each decode pool that exists;
    router_deployment: the router's Deployment, or None (none wanted, or not created yet);
    router_problem: the worst problem of the router's pods, or None.
    With a router the endpoint is the router Service and Ready needs a ready router pod.
    """
    meta = isvc["metadata"]
    name, namespace = meta["name"], meta.get("namespace", "default")
    wanted = [d["name"] for d in isvc["spec"]["decode"]]
    by_pool = {p["spec"]["poolName"]: (p, s) for p, s in decodes}
    router = router_status(isvc, router_deployment, router_problem)
    router_here = router is not None and router_deployment is not None
    # observedGeneration: the InferenceService generation every current pool was built from.
    current = ([prefill] if prefill else []) + [by_pool[n] for n in wanted if n in by_pool]
    current += [router] if router_here else []
    built_from = [naming.owner_generation(p) for p, _ in current]
    complete = prefill is not None and all(n in by_pool for n in wanted) and (router is None or router_here)
    generation = min(built_from) if complete and None not in built_from else None
    decode_summaries = [_summary(n, *by_pool[n]) for n in wanted if n in by_pool]
    prefill_summary = _summary("prefill", *prefill) if prefill else {"name": "prefill", "replicas": 0,
                                                                     "readyReplicas": 0, "ready": False}
    router_summary = _summary("router", *router) if router else None
    missing = [n for n in wanted if n not in by_pool] + ([] if prefill else ["prefill"])
    missing += ["router"] if router is not None and not router_here else []
    ready_decodes = [d["name"] for d in decode_summaries if d["ready"]]

    if missing:
        ready = condition("Ready", False, "PoolsMissing", "pools not created yet: " + ", ".join(missing), generation)
    elif not prefill_summary["ready"]:
        ready = condition("Ready", False, "PrefillNotReady", "no prefill pod is ready", generation)
    elif not ready_decodes:
        ready = condition("Ready", False, "NoDecodePoolReady", "no decode pool has a ready pod", generation)
    elif router_summary is not None and not router_summary["ready"]:
        ready = condition("Ready", False, "RouterNotReady", "no router pod is ready (the endpoint is the router)",
                          generation)
    else:
        ready = condition("Ready", True, "Serving", "prefill ready; decode pools ready: " + ", ".join(ready_decodes)
                          + ("; router ready" if router_summary else ""), generation)

    statuses = ([("prefill", prefill[1])] if prefill else []) + [(p["spec"]["poolName"], s) for p, s in decodes]
    statuses += [("router", router[1])] if router_here else []
    rolling = [n for n, s in statuses if _is_true(s, "Progressing")] + missing
    progressing = condition("Progressing", bool(rolling), "PoolsRollingOut" if rolling else "Stable",
                            ("rolling out or scaling: " + ", ".join(rolling)) if rolling else "all pools settled",
                            generation)

    degraded_pools = [(n, _condition(s, "Degraded")) for n, s in statuses if _is_true(s, "Degraded")]
    summaries = [prefill_summary, *decode_summaries, *([router_summary] if router_summary else [])]
    idle = [s["name"] for s in summaries if s["replicas"] > 0 and not s["ready"]]
    if degraded_pools:
        degraded = condition("Degraded", True, degraded_pools[0][1].get("reason") or "PoolDegraded",
                             "; ".join(f"{n}: {c.get('message') or c.get('reason')}" for n, c in degraded_pools),
                             generation)
    elif ready["status"] == "True" and idle:
        degraded = condition("Degraded", True, "PoolUnavailable", "pools without a ready pod: " + ", ".join(idle),
                             generation)
    else:
        degraded = condition("Degraded", False, "AsExpected", "", generation)

    decode_ready = sum(d["readyReplicas"] for d in decode_summaries)
    decode_desired = sum(d["replicas"] for d in decode_summaries)
    protocol = (prefill[0]["spec"].get("protocolVersion") if prefill else None)
    front_door = naming.router_name(name) if router else naming.prefill_name(name)
    status = {
        "endpoint": f"http://{front_door}.{namespace}.svc:{defaults.HTTP_PORT}",
        "prefillReady": f"{prefill_summary['readyReplicas']}/{prefill_summary['replicas']}",
        "decodeReady": f"{decode_ready}/{decode_desired}",
        # None removes the field (status is merge-patched) once the router is scaled to 0
        "routerReady": f"{router_summary['readyReplicas']}/{router_summary['replicas']}" if router_summary else None,
        "prefill": prefill_summary,
        "decode": decode_summaries,
        "router": router_summary,
        "conditions": [ready, progressing, degraded],
    }
    if protocol:
        status["protocolVersion"] = protocol
    if generation is not None:
        status["observedGeneration"] = generation
    return status
