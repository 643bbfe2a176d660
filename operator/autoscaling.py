"""Autoscaling of an InferenceService's pools (``spec.autoscaling``): the planner in the operator.

A kopf daemon runs on each InferenceService with ``spec.autoscaling.enabled`` (it stops when
autoscaling is turned off) and does one round every ``intervalSeconds``:

1. **observe** - the pools (PrefillPool, DecodePools) and their ready pods; a ``Window`` per
   pool over ``windowSeconds`` from the metrics source (autoscaling_metrics.py: the
   Prometheus of ``--prometheus-url``, else the pods' own /metrics);
2. **decide** - one ``pdserve.planner.Planner`` per pool (its memory: stabilisation, cooldown,
   confirmation) with ``spec.slo`` as targets and ``spec.autoscaling`` bounds and timings;
3. **apply** - through the pool's scale subresource, as ``kubectl scale`` would. Before a
   scale-down, every ready pod of the pool gets ``controller.kubernetes.io/pod-deletion-cost``
   ranked by its requests in flight, so the ReplicaSet removes the least loaded pod; that pod
   then drains (preStop, SIGTERM: it stops taking work, finishes its requests within the
   grace period, sized to the longest request: workloads.py) before it goes;
4. **record** - ``status.autoscaling`` (each pool: current, desired, ready, signal, reason, the
   last change) and a Kubernetes Event (ScaledUp / ScaledDown, or MetricsUnavailable) on the
   InferenceService.

With autoscaling off nothing here runs: replicas are the user's (``kubectl scale`` on a pool
lasts, as handlers.py documents). Planner memory lives in the operator process; a restarted
operator watches a whole stabilisation window before it scales anything down.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import kopf
from kubernetes.client.exceptions import ApiException

from pdserve.operator import crds, naming, workloads
from pdserve.operator.handlers import plain
from pdserve.operator.autoscaling_metrics import MetricsUnavailable, PodsSource, PoolRef, PrometheusSource
from pdserve.planner import Decision, Planner, PlannerConfig, PoolLimits

G, V = naming.GROUP, naming.VERSION
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
log = logging.getLogger(__name__)


def enabled(spec, **_) -> bool:
    return bool((spec or {}).get("autoscaling", {}).get("enabled"))


def planner_config(isvc: dict) -> PlannerConfig:
    """Targets from spec.slo, bounds and timings from spec.autoscaling (schema defaults filled in)."""
    spec = isvc["spec"]
    auto, slo = spec.get("autoscaling") or {}, spec.get("slo") or {}
    bounds = {pool: PoolLimits((auto.get(pool) or {}).get("minReplicas", 1),
                               (auto.get(pool) or {}).get("maxReplicas", 4))
              for pool in ("prefill", "decode")}
    return PlannerConfig(ttft_target_s=slo.get("ttftMs", crds.DEFAULT_TTFT_MS) / 1000,
                         tbt_target_s=slo.get("tbtMs", crds.DEFAULT_TBT_MS) / 1000,
                         down_stabilisation_s=float(auto.get("scaleDownStabilizationSeconds", 300)),
                         cooldown_s=float(auto.get("cooldownSeconds", 60)), **bounds)


@dataclass
class IsvcState:
    """What the operator remembers of one InferenceService between rounds."""

    config: PlannerConfig
    planners: dict[str, Planner] = field(default_factory=dict)  # pool object name -> its planner
    last_change: dict[str, tuple[str, str]] = field(default_factory=dict)  # pool -> (time, reason)
    unavailable: str = ""


def _ready_pods(api, namespace: str, pool: dict) -> dict[str, str]:
    pods = api.list("Pod", namespace, workloads.pool_selector(pool))
    out = {}
    for pod in pods:
        status, meta = pod.get("status") or {}, pod["metadata"]
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if ready and status.get("podIP") and not meta.get("deletionTimestamp"):
            out[meta["name"]] = status["podIP"]
    return out


def pool_refs(api, namespace: str, isvc_name: str) -> tuple[list[PoolRef], dict[str, dict]]:
    """The pools of an InferenceService with their ready pods, and the pool objects by name."""
    objs = [api.get("PrefillPool", namespace, naming.prefill_name(isvc_name)),
            *api.list("DecodePool", namespace, {naming.LABEL_ISVC: isvc_name})]
    refs, by_name = [], {}
    for obj in (o for o in objs if o):
        role = "prefill" if obj["kind"] == "PrefillPool" else "decode"
        name = obj["metadata"]["name"]
        refs.append(PoolRef(name, role, "prefill" if role == "prefill" else obj["spec"]["poolName"],
                            _ready_pods(api, namespace, obj)))
        by_name[name] = obj
    return refs, by_name


def rank_for_deletion(loads: dict[str, float], pods: list[str]) -> dict[str, int]:
    """pod -> deletion cost: the least loaded pod the lowest (removed first); a pod with no
    reading counts as idle; ties go by name so the ranking is stable."""
    order = sorted(pods, key=lambda p: (loads.get(p, 0.0), p))
    return {pod: rank for rank, pod in enumerate(order)}


def set_deletion_costs(api, namespace: str, ref: PoolRef, loads: dict[str, float]) -> dict[str, int]:
    costs = rank_for_deletion(loads, sorted(ref.ready_pods))
    for pod, cost in costs.items():
        api.patch("Pod", namespace, pod, {"metadata": {"annotations": {DELETION_COST: str(cost)}}})
    return costs


def run_round(api, source, isvc: dict, state: IsvcState, now: float, post_event) -> list[Decision]:
    """One observe -> decide -> apply -> record round; returns the decisions that changed a pool."""
    meta, auto = isvc["metadata"], isvc["spec"].get("autoscaling") or {}
    namespace, name = meta["namespace"], meta["name"]
    refs, objs = pool_refs(api, namespace, name)
    try:
        windows = source.windows(namespace, name, refs, float(auto.get("windowSeconds", 60)),
                                 state.config.latency_quantile, now)
        state.unavailable = ""
    except MetricsUnavailable as exc:
        if str(exc) != state.unavailable:  # one Event per new problem, not one per round
            post_event("Warning", "MetricsUnavailable", f"autoscaling holds: {exc}")
        state.unavailable = str(exc)
        return []
    decisions, changed = [], []
    for ref in refs:
        window = windows.get(ref.name)
        if window is None:
            continue
        planner = state.planners.setdefault(ref.name, Planner(state.config))
        current = int(objs[ref.name]["spec"].get("replicas", crds.DEFAULT_REPLICAS))
        plan = planner.decide(window, {"prefill": current, "decode": current}, now)
        decision = plan.prefill if ref.role == "prefill" else plan.decode
        decisions.append((ref, decision))
        if decision.direction:
            if decision.direction < 0:
                set_deletion_costs(api, namespace, ref, source.pod_loads(namespace, name, ref))
            api.scale(objs[ref.name]["kind"], namespace, ref.name, decision.desired)
            state.last_change[ref.name] = (_timestamp(), decision.reason)
            post_event("Normal", "ScaledUp" if decision.direction > 0 else "ScaledDown",
                       f"{objs[ref.name]['kind']} {ref.name}: {decision.current} -> "
                       f"{decision.desired}: {decision.reason}")
            changed.append(decision)
    if decisions:
        api.patch_status("InferenceService", namespace, name, {"autoscaling": _status(source.kind, decisions, state)})
    return changed


def _status(kind: str, decisions, state: IsvcState) -> dict:
    pools = []
    for ref, d in decisions:
        entry = {"name": ref.name, "role": ref.role, "current": d.current, "desired": d.desired, "ready": d.ready,
                 "signal": d.signal, "reason": d.reason}
        if ref.name in state.last_change:
            entry["lastScaleTime"], entry["lastScaleReason"] = state.last_change[ref.name]
        pools.append(entry)
    return {"source": kind, "lastDecisionTime": _timestamp(), "pools": pools}


def _timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@kopf.daemon(G, V, "inferenceservices", when=enabled, cancellation_timeout=5.0)
def isvc_autoscale(stopped, body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger,
                   **_) -> None:
    """One round every spec.autoscaling.intervalSeconds while autoscaling is on (kopf stops the
    daemon when it is turned off or the InferenceService goes; ``body`` is always the latest)."""
    with _memo_guard:
        if not hasattr(memo, "autoscaling"):
            memo.autoscaling = {"states": {}, "source": _source(memo)}
    states, source = memo.autoscaling["states"], memo.autoscaling["source"]
    key = f"{namespace}/{name}"

    def post(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message[:1000])

    while not stopped:
        isvc = plain(body)
        config = planner_config(isvc)
        state = states.get(key)
        if state is None or state.config != config:  # new, or its bounds/targets/timings changed: start afresh
            state = states[key] = IsvcState(config)
        try:
            for d in run_round(memo.api, source, isvc, state, time.monotonic(), post):
                logger.info(f"autoscaling {d.describe()}")
        except ApiException as e:  # the next round retries
            logger.warning(f"autoscaling round failed: {e.status} {e.reason}")
        stopped.wait(float((isvc["spec"].get("autoscaling") or {}).get("intervalSeconds", 15)))
    states.pop(key, None)
    if isinstance(source, PodsSource):
        source.forget(namespace, name)


_memo_guard = threading.Lock()


def _source(memo: kopf.Memo):
    url = getattr(memo.config, "prometheus_url", None)
    return PrometheusSource(url) if url else PodsSource()
