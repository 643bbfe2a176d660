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
    wanted = [d["name"] for d in isvc["spec"]["decode"]]
    by_pool = {p["spec"]["poolName"]: (p, s) for p, s in decodes}
    current_decodes = [by_pool[n] for n in wanted if n in by_pool]  # in spec.decode's order
    router = router_status(isvc, router_deployment, router_problem)
    built_router = router if router_deployment is not None else None  # the router once its Deployment exists
    missing = _missing_pools(wanted, by_pool, prefill, router is not None and built_router is None)
    current = ([prefill] if prefill else []) + current_decodes + ([built_router] if built_router else [])
    generation = _observed_generation(current, missing)
    prefill_summary = _prefill_summary(prefill)
    decode_summaries = [_summary(p["spec"]["poolName"], p, s) for p, s in current_decodes]
    router_summary = _summary("router", *router) if router else None
    summaries = [prefill_summary, *decode_summaries, *([router_summary] if router_summary else [])]
    statuses = _existing_statuses(prefill, decodes, built_router)

    ready = _ready_condition(missing, prefill_summary, decode_summaries, router_summary, generation)
    status = {
        "endpoint": _endpoint(isvc, router is not None),
        **_ready_counts(prefill_summary, decode_summaries, router_summary),
        "prefill": prefill_summary,
        "decode": decode_summaries,
        "router": router_summary,
        "conditions": [ready, _progressing_condition(statuses, missing, generation),
                       _degraded_condition(statuses, summaries, ready["status"] == "True", generation)],
    }
    protocol = prefill[0]["spec"].get("protocolVersion") if prefill else None
    if protocol:
        status["protocolVersion"] = protocol
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def _prefill_summary(prefill: tuple[dict, dict] | None) -> dict:
    """The prefill pool's summary; no pods, not ready, while the pool does not exist yet."""
    if prefill is None:
        return {"name": "prefill", "replicas": 0, "readyReplicas": 0, "ready": False}
    return _summary("prefill", *prefill)


def _missing_pools(wanted: list[str], decodes: dict[str, tuple[dict, dict]], prefill: tuple[dict, dict] | None,
                   router_missing: bool) -> list[str]:
    """The pools not created yet: wanted decode pools (spec.decode's order), then prefill, then router."""
    return ([n for n in wanted if n not in decodes] + ([] if prefill else ["prefill"])
            + (["router"] if router_missing else []))


def _observed_generation(current: list[tuple[dict, dict]], missing: list[str]) -> int | None:
    """The InferenceService generation every current pool was built from (the oldest of their owner
    generations); None while a pool is missing or one does not say what it was built from."""
    built_from = [naming.owner_generation(pool) for pool, _ in current]
    return None if missing or None in built_from else min(built_from)


def _existing_statuses(prefill: tuple[dict, dict] | None, decodes: list[tuple[dict, dict]],
                       router: tuple[dict, dict] | None) -> list[tuple[str, dict]]:
    """(name, status) of every pool that exists, the order conditions name them in: prefill, the decode
    pools as given (one no longer in spec.decode too, until it is deleted), router."""
    return ([("prefill", prefill[1])] if prefill else []) + [(p["spec"]["poolName"], s) for p, s in decodes] + (
        [("router", router[1])] if router else [])


def _ready_condition(missing: list[str], prefill: dict, decodes: list[dict], router: dict | None,
                     generation: int | None) -> dict:
    """Ready, from the pool summaries: every pool created, a prefill pod ready, a decode pool with a ready
    pod and, with a router, a router pod (the first that fails is the reason)."""
    ready_decodes = [d["name"] for d in decodes if d["ready"]]
    if missing:
        return condition("Ready", False, "PoolsMissing", "pools not created yet: " + ", ".join(missing), generation)
    if not prefill["ready"]:
        return condition("Ready", False, "PrefillNotReady", "no prefill pod is ready", generation)
    if not ready_decodes:
        return condition("Ready", False, "NoDecodePoolReady", "no decode pool has a ready pod", generation)
    if router is not None and not router["ready"]:
        return condition("Ready", False, "RouterNotReady", "no router pod is ready (the endpoint is the router)",
                         generation)
    return condition("Ready", True, "Serving", "prefill ready; decode pools ready: " + ", ".join(ready_decodes)
                     + ("; router ready" if router else ""), generation)


def _progressing_condition(statuses: list[tuple[str, dict]], missing: list[str], generation: int | None) -> dict:
    """Progressing while a pool rolls out or scales, or is still to be created."""
    rolling = [n for n, s in statuses if _is_true(s, "Progressing")] + missing
    return condition("Progressing", bool(rolling), "PoolsRollingOut" if rolling else "Stable",
                     ("rolling out or scaling: " + ", ".join(rolling)) if rolling else "all pools settled", generation)


def _degraded_condition(statuses: list[tuple[str, dict]], summaries: list[dict], ready: bool,
                        generation: int | None) -> dict:
    """Degraded: the first degraded pool's reason with every degraded pool's message; else PoolUnavailable
    when the service is Ready but a pool that should serve has no ready pod."""
    degraded = [(n, _condition(s, "Degraded")) for n, s in statuses if _is_true(s, "Degraded")]
    if degraded:
        return condition("Degraded", True, degraded[0][1].get("reason") or "PoolDegraded",
                         "; ".join(f"{n}: {c.get('message') or c.get('reason')}" for n, c in degraded), generation)
    idle = [s["name"] for s in summaries if s["replicas"] > 0 and not s["ready"]]
    if ready and idle:
        return condition("Degraded", True, "PoolUnavailable", "pools without a ready pod: " + ", ".join(idle),
                         generation)
    return condition("Degraded", False, "AsExpected", "", generation)


def _ready_counts(prefill: dict, decodes: list[dict], router: dict | None) -> dict:
    """"ready/wanted" pods of the prefill pool, of all decode pools together, and of the router."""
    return {
        "prefillReady": f"{prefill['readyReplicas']}/{prefill['replicas']}",
        "decodeReady": f"{sum(d['readyReplicas'] for d in decodes)}/{sum(d['replicas'] for d in decodes)}",
        # None removes the field (status is merge-patched) once the router is scaled to 0
        "routerReady": f"{router['readyReplicas']}/{router['replicas']}" if router else None,
    }


def _endpoint(isvc: dict, has_router: bool) -> str:
    """The InferenceService's URL in the cluster: its router Service, or without a router its prefill Service."""
    meta = isvc["metadata"]
    front_door = naming.router_name(meta["name"]) if has_router else naming.prefill_name(meta["name"])
    return f"http://{front_door}.{meta.get('namespace', 'default')}.svc:{defaults.HTTP_PORT}"
