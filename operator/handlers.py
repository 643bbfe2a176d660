"""The kopf handlers: InferenceService -> pools -> Deployments/Services, and status back up.

Reconcile flow (every step is an idempotent server-side apply, so a restart anywhere in it
just runs it again; kopf re-runs unfinished handlers and ``on.resume`` covers the rest):

1. ``isvc_reconcile`` (create / update / resume of an InferenceService): apply (with ``--tls``)
   its certificate's Secrets when missing or due (``tls_issuer``; also ``tls_renewal``, hourly), its
   PrefillPool, DecodePools, router (Deployment, Service, RBAC: ``router_workloads``) and
   (when enabled) NetworkPolicies, adopted by it; delete DecodePools it no longer lists,
   and the router's objects when ``spec.router.replicas`` is 0.
2. ``pool_reconcile`` (create / update / resume of a PrefillPool or DecodePool, including
   ``kubectl scale``): apply the pool's Deployment, Service and (prefill) RBAC, adopted by it;
   a DecodePool whose protocol version changes first keeps its old Service under another
   name (``protocol_rollout``).
3. ``deployment_event`` (any event of a Deployment the operator made): recompute the
   statuses of its pools and InferenceService from the Deployments and pods, and delete the
   retired decode Services the prefills no longer need.
4. ``pod_event`` (an event of a pool's or router's pod whose problem, ``pod_problems``,
   appeared, changed or went): the same recompute. A pod that cannot pull its image, cannot
   be scheduled or crashes changes nothing in its Deployment's status, so without this watch
   Degraded would wait for the Deployment's progress deadline (600 s); with it, it follows
   the pod within a second. Each new problem becomes a Warning Event on the pool and the
   InferenceService, once (``problem_events``).

5. ``download_job_event`` (an event of a download Job: ``spec.model.cache`` on a claim,
   ``model_cache``): its progress annotation or end changes the InferenceService's
   ``status.model``; the current Job, deleted to retry a failed download, is made again.
   ``isvc_reconcile`` applies the Job (and once, the claim) and deletes Jobs of an earlier source.

Deletion is the garbage collector's job (ownerReferences), so no finalizers are added and
an InferenceService can be deleted even while the operator is down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import kopf
from kubernetes.client.exceptions import ApiException

from pdserve.operator import (model_cache, naming, pod_problems, pools, problem_events, protocol_rollout,
                              router_workloads, status, tls_issuer, workloads)
from pdserve.operator.kubeapi import KubeApi, make_api_client

G, V = naming.GROUP, naming.VERSION
RETRY_DELAY_S = 5
# The pods the operator watches: those of its pools and routers (naming.common_labels).
POD_LABELS = {naming.LABEL_MANAGED_BY: naming.MANAGER, naming.LABEL_ISVC: kopf.PRESENT}


def plain(obj: object) -> object:
    """kopf's body views -> plain dicts and lists (what the builders take)."""
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def _apply_all(api: KubeApi, objs: list[dict]) -> None:
    for obj in objs:
        try:
            api.apply(obj)
        except ApiException as e:
            what = f"{obj['kind']} {obj['metadata'].get('namespace')}/{obj['metadata']['name']}"
            if e.status == 404 and obj["apiVersion"].startswith("cert-manager.io/"):
                raise kopf.TemporaryError(f"cannot apply {what}: cert-manager is not installed (no "
                                          f"{obj['apiVersion']} API); install it or run the operator with --tls "
                                          "self-signed", delay=60) from e
            if e.status in (400, 403, 422):
                # Not fixed by retrying soon; say what and why (RBAC, schema), then retry slowly.
                raise kopf.TemporaryError(f"cannot apply {what}: {e.status} {e.reason}: {e.body}", delay=60) from e
            raise kopf.TemporaryError(f"cannot apply {what}: {e.status} {e.reason}", delay=RETRY_DELAY_S) from e


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    """All operator settings, and the one API client every handler shares."""
    # Progress and the last handled spec live in annotations, so status stays ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=naming.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=naming.GROUP, key="last-handled-configuration")
    # Watches are re-established every few minutes, so a silently dropped connection
    # (load balancers idle-kill long requests) costs at most that much staleness.
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    # A connect attempt that hangs should fail fast and be retried.
    settings.watching.connect_timeout = 30
    # Only our pools' pods reach the operator (filtered by the API server, not after the fact).
    settings.watching.label_selectors["v1", "pods"] = f"{naming.LABEL_MANAGED_BY}={naming.MANAGER},{naming.LABEL_ISVC}"
    # Sync handlers run in this thread pool. They mostly wait on API round trips, so many
    # threads overlap them (bench/tools/operator_converge.py, one run each on a loaded 2-core box:
    # with 8, pool reconciles finished ~40 s after the 50th InferenceService was created;
    # with 32, ~6 s after).
    settings.execution.max_workers = 32
    # Kubernetes Events only for warnings and errors (reconciles are frequent): handler failures
    # and the pools' problems (problem_events).
    settings.posting.level = logging.WARNING
    # After an API error, handlers retry every RETRY_DELAY_S seconds (TemporaryError), forever.
    settings.networking.request_timeout = 60
    memo.api = KubeApi(make_api_client(memo.get("kubeconfig"), pool_size=settings.execution.max_workers))
    memo.status_state = {}  # "ns/name" -> {"running", "dirty"}: see refresh_status
    memo.status_guard = threading.Lock()
    memo.pods_with_problems = {}  # pod uid -> (reason, detail) of its problem, for pods that have one: see pod_event
    memo.problem_ledger = problem_events.ProblemLedger(started=status.now())


@kopf.on.resume(G, V, "inferenceservices")
@kopf.on.create(G, V, "inferenceservices")
@kopf.on.update(G, V, "inferenceservices")
def isvc_reconcile(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_) -> None:
    api: KubeApi = memo.api
    isvc = plain(body)
    existing_decodes = {p["metadata"]["name"]: p for p in api.list("DecodePool", namespace, {naming.LABEL_ISVC: name})}
    prefill = pools.build_prefill_pool(isvc, memo.config, api.get("PrefillPool", namespace, naming.prefill_name(name)))
    decodes = pools.build_decode_pools(isvc, memo.config, existing_decodes)
    router = router_workloads.build_router(isvc, memo.config)
    children = [*tls_issuer.objects(api, isvc, memo.config), prefill, *decodes, *router]  # certificates first
    if memo.config.network_policy:
        children += pools.build_network_policies(isvc, memo.config)
    children += _model_cache_children(api, isvc, memo.config)
    kopf.adopt(children, owner=body)
    _apply_all(api, children)
    for stale in model_cache.stale_jobs(isvc, api.list("Job", namespace, model_cache.selector(name))):
        logger.info(f"deleting download Job {stale}: spec.model changed")
        api.delete("Job", namespace, stale)
    if not router:  # spec.router.replicas: 0 (perhaps since they were made): the prefill is the front door
        for kind, child in router_workloads.router_object_names(name):
            api.delete(kind, namespace, child)
    if not memo.config.network_policy:  # turned off since they were made: remove them
        for policy in api.list("NetworkPolicy", namespace, {naming.LABEL_ISVC: name}):
            api.delete("NetworkPolicy", namespace, policy["metadata"]["name"])
    for stale in pools.stale_decode_pools(isvc, list(existing_decodes)):
        logger.info(f"deleting DecodePool {stale}: no longer in spec.decode")
        api.delete("DecodePool", namespace, stale)
    refresh_status(api, memo, namespace, name)
    logger.info(f"reconciled {namespace}/{name}: {len(children)} children applied")


@kopf.timer(G, V, "inferenceservices", interval=tls_issuer.CHECK_INTERVAL_S, initial_delay=tls_issuer.CHECK_INTERVAL_S)
def tls_renewal(body: kopf.Body, memo: kopf.Memo, **_) -> None:
    """Renew an InferenceService's certificate between reconciles (self-signed mode; tls_issuer.py)."""
    if memo.config.tls != "self-signed":
        return
    renewed = tls_issuer.objects(memo.api, plain(body), memo.config)
    kopf.adopt(renewed, owner=body)
    _apply_all(memo.api, renewed)


def _model_cache_children(api: KubeApi, isvc: dict, config) -> list[dict]:
    """The download Job and its RBAC (spec.model.cache on a claim), and the claim while it does not exist
    (created once: its spec is immutable)."""
    claim = model_cache.build_claim(isvc, config)
    meta = isvc["metadata"]
    new_claim = [claim] if claim and api.get("PersistentVolumeClaim", meta["namespace"],
                                              claim["metadata"]["name"]) is None else []
    return [*new_claim, *model_cache.build(isvc, config)]


DOWNLOAD_JOB_LABELS = {naming.LABEL_MANAGED_BY: naming.MANAGER, naming.LABEL_ROLE: model_cache.ROLE}


@kopf.on.event("batch", "v1", "jobs", labels=DOWNLOAD_JOB_LABELS)
def download_job_event(body: kopf.Body, type: str | None, namespace: str, memo: kopf.Memo, **_) -> None:
    """A download Job's progress (its annotation) or end: refresh the status. A current Job deleted (to retry a
    failed download): make it again."""
    isvc_name = body.get("metadata", {}).get("labels", {}).get(naming.LABEL_ISVC)
    if not (isvc_name and namespace):
        return
    api: KubeApi = memo.api
    try:
        if type == "DELETED":
            isvc = api.get("InferenceService", namespace, isvc_name)
            if (isvc and not isvc["metadata"].get("deletionTimestamp") and model_cache.cache_claim(isvc)
                    and model_cache.job_name(isvc) == body["metadata"]["name"]):
                children = model_cache.build(isvc, memo.config)
                kopf.adopt(children, owner=isvc)
                _apply_all(api, children)
        refresh_status(api, memo, namespace, isvc_name)
    except (ApiException, kopf.TemporaryError) as e:  # not retried: the next event or reconcile repairs it
        logging.getLogger(__name__).warning(f"download Job {namespace}/{body['metadata'].get('name')}: {e}")


@kopf.on.resume(G, V, "prefillpools")
@kopf.on.create(G, V, "prefillpools")
@kopf.on.update(G, V, "prefillpools")
@kopf.on.resume(G, V, "decodepools")
@kopf.on.create(G, V, "decodepools")
@kopf.on.update(G, V, "decodepools")
def pool_reconcile(body: kopf.Body, namespace: str, memo: kopf.Memo, **_) -> None:
    pool = plain(body)
    children = workloads.build_children(pool)
    if pool["kind"] == "DecodePool":  # a protocol change: keep the old version's Service until prefills rolled
        service = next(c for c in children if c["kind"] == "Service")
        retired = protocol_rollout.retired_service(memo.api.get("Service", namespace, service["metadata"]["name"]),
                                                   service)
        children = [retired, *children] if retired else children
    kopf.adopt(children, owner=body)
    _apply_all(memo.api, children)
    refresh_status(memo.api, memo, namespace, pool["spec"]["inferenceService"])


@kopf.on.event("apps", "v1", "deployments", labels={naming.LABEL_MANAGED_BY: naming.MANAGER})
def deployment_event(body: kopf.Body, namespace: str, memo: kopf.Memo, **_) -> None:
    isvc = body.get("metadata", {}).get("labels", {}).get(naming.LABEL_ISVC)
    if isvc and namespace:
        try:
            refresh_status(memo.api, memo, namespace, isvc)
        except ApiException as e:  # event handlers are not retried: the next event or reconcile repairs it
            logging.getLogger(__name__).warning(f"status of {namespace}/{isvc} not refreshed: {e.status} {e.reason}")


@kopf.on.event("v1", "pods", labels=POD_LABELS)
def pod_event(body: kopf.Body, type: str | None, uid: str, namespace: str, memo: kopf.Memo, **_) -> None:
    """Refresh the statuses when this pod's problem appears, changes or goes (readiness alone: deployment_event)."""
    problem = None if type == "DELETED" else pod_problems.pod_problem(plain(body))
    now = (problem.reason, problem.detail) if problem else None
    before = memo.pods_with_problems.pop(uid, None) if now is None else memo.pods_with_problems.get(uid)
    if now is not None:
        memo.pods_with_problems[uid] = now
    isvc = body.get("metadata", {}).get("labels", {}).get(naming.LABEL_ISVC)
    if now != before and isvc and namespace:
        try:
            refresh_status(memo.api, memo, namespace, isvc)
        except ApiException as e:  # event handlers are not retried: the next event or reconcile repairs it
            logging.getLogger(__name__).warning(f"status of {namespace}/{isvc} not refreshed: {e.status} {e.reason}")


def refresh_status(api: KubeApi, memo: kopf.Memo, namespace: str, isvc_name: str) -> None:
    """Recompute and write the statuses of an InferenceService's pools and of itself.

    Coalesced per InferenceService: its Deployments' events arrive in bursts and
    concurrently, so a call that finds a refresh of the same service running only marks it
    dirty and returns; the running one then reads everything again once more. Writes only
    what changed, then posts the Warning Events of problems not announced yet.
    """
    key = f"{namespace}/{isvc_name}"
    with memo.status_guard:
        state = memo.status_state.setdefault(key, {"running": False, "dirty": False})
        if state["running"]:
            state["dirty"] = True
            return
        state["running"] = True
    try:
        while True:
            for health in _refresh_once(api, namespace, isvc_name) or ():
                if memo.problem_ledger.is_new(health):
                    problem_events.post(health)
            with memo.status_guard:
                # Decide to stop and clear "running" in one critical section: a caller that
                # comes in between would otherwise mark it dirty with nobody left to redo it.
                if not state["dirty"]:
                    state["running"] = False
                    return
                state["dirty"] = False
    except BaseException:
        with memo.status_guard:
            state["running"] = False
        raise


def _changed(old: dict | None, new: dict) -> bool:
    def plain_value(v):  # a nested None removes a key (merge patch), so it equals an absent key
        return {k: x for k, x in v.items() if x is not None} if isinstance(v, dict) else v

    return any(plain_value((old or {}).get(k)) != plain_value(v) for k, v in new.items())


def _refresh_once(api: KubeApi, namespace: str, isvc_name: str) -> list[problem_events.PoolHealth]:
    """Compute and write the statuses; return each pool's (and the router's) Degraded condition."""
    isvc = api.get("InferenceService", namespace, isvc_name)
    if isvc is None:
        return []
    selector = {naming.LABEL_ISVC: isvc_name}
    pods = api.list("Pod", namespace, selector)
    deployments = {d["metadata"]["name"]: d for d in api.list("Deployment", namespace, selector)}
    prefill_pool = api.get("PrefillPool", namespace, naming.prefill_name(isvc_name))
    decode_pools = api.list("DecodePool", namespace, selector)
    now = status.now()
    health: list[problem_events.PoolHealth] = []

    def problem_of(labels: dict[str, str]) -> pod_problems.PodProblem | None:
        return pod_problems.pool_problem([p for p in pods if pod_problems.matches(p, labels)])

    def note(key: str, name: str, pool: dict | None, degraded: dict, problem, stored: dict | None) -> None:
        same = problem is not None and degraded["reason"] == problem.reason
        subject = problem.subject if same else (degraded["reason"], degraded.get("message", ""))
        health.append(problem_events.PoolHealth(key, name, pool, isvc, degraded, subject, stored))

    def pool_status(pool: dict) -> dict:
        problem = problem_of(workloads.pool_selector(pool))
        new = status.pool_status(pool, deployments.get(pool["metadata"]["name"]),
                                 naming.label_selector(workloads.pool_selector(pool)), problem)
        old = pool.get("status") or {}
        new["conditions"] = status.merge_conditions(old.get("conditions"), new["conditions"], now)
        if _changed(old, new):
            api.patch_status(pool["kind"], namespace, pool["metadata"]["name"], new)
        name = pool["spec"].get("poolName", "prefill")
        note(pool["metadata"].get("uid", name), name, pool, _degraded(new), problem, _degraded(old))
        return new

    prefill = (prefill_pool, pool_status(prefill_pool)) if prefill_pool else None
    decodes = [(p, pool_status(p)) for p in decode_pools]
    protocol_rollout.prune(api, namespace, isvc_name, deployments)
    router_deployment = deployments.get(naming.router_name(isvc_name))
    router_problem = problem_of(naming.selector_labels(isvc_name, router_workloads.ROLE, router_workloads.ROLE))
    new = status.isvc_status(isvc, prefill, decodes, router_deployment, router_problem)
    new = model_cache.with_model(new, _model_status(api, isvc, pods), new.get("observedGeneration"))
    old = isvc.get("status") or {}
    new["conditions"] = status.merge_conditions(old.get("conditions"), new["conditions"], now)
    if _changed(old, new):
        api.patch_status("InferenceService", namespace, isvc_name, new)
    router = status.router_status(isvc, router_deployment, router_problem)
    if router is not None and router_deployment is not None:
        note(f"{isvc['metadata'].get('uid')}/router", "router", None, _degraded(router[1]), router_problem,
             _degraded(old))
    return health


def _model_status(api: KubeApi, isvc: dict, pods: list[dict]) -> dict | None:
    """status.model: the download Job of spec.model.cache on a claim, and its pods (None without one)."""
    if model_cache.cache_claim(isvc) is None:
        return None
    meta = isvc["metadata"]
    job = api.get("Job", meta["namespace"], model_cache.job_name(isvc))
    mine = model_cache.selector(meta["name"])
    return model_cache.model_status(isvc, job, [p for p in pods if pod_problems.matches(p, mine)])


def _degraded(pool_or_isvc_status: dict) -> dict | None:
    return next((c for c in pool_or_isvc_status.get("conditions") or [] if c.get("type") == "Degraded"), None)


def new_memo(config, kubeconfig: str | None = None) -> kopf.Memo:
    """The memo the operator runs with: config now, the API client at start-up (configure)."""
    memo = kopf.Memo()
    memo.config = config
    memo.kubeconfig = kubeconfig
    return memo


__all__ = ["configure", "isvc_reconcile", "pool_reconcile", "deployment_event", "pod_event", "download_job_event",
           "refresh_status", "new_memo", "make_api_client", "tls_renewal"]
