"""spec.model.cache on a claim: an hf:// model fetched once per InferenceService, not once per pod.

With ``spec.model.cache.size`` (the operator makes the claim ``<isvc>-model-cache``: ``storageClassName``,
``accessMode``, default ReadWriteOnce) or ``spec.model.cache.pvcName`` (the user's claim), the operator
builds, beside the pools (pure builders here; ``handlers.isvc_reconcile`` applies them):

- the claim (``size`` only; created once, never re-applied: a claim's spec is immutable but for its size,
  which the user may grow with ``kubectl edit pvc``);
- ``<isvc>-model-<digest>``: one Job (``BACKOFF_LIMIT`` retries) whose pod runs ``pdserve fetch-model SRC
  --dest /model-cache/org/name/rev --progress-job <job>`` with the claim mounted read-write and the token
  (``spec.model.tokenSecret``) as HF_TOKEN. ``digest`` covers the source, endpoint and token Secret, so a
  change to any of them is a new Job (a Job's pod template cannot change) and the old one is deleted
  (``stale_jobs``); a failed Job is retried by deleting it (the operator makes it again);
- ServiceAccount, Role and RoleBinding ``<isvc>-model-download``: the Job's pod may ``get`` and ``patch``
  that one Job (``resourceNames``), nothing else: where it writes its progress (the annotation
  ``model_fetch_progress.ANNOTATION``: bytes and files done, or the failure's reason and line).

The pools' pods mount the claim read-only and wait (init container ``wait-model``) for the Job's
completion marker (model_pods.py); the router takes its tokenizer files from a prefill. So the Hub
serves one copy of the model whatever the number of pods.

``model_status`` (from the Job, its annotation and its pods) is ``status.model`` of the InferenceService
(phase Pending / Downloading / Downloaded / Failed, bytes and files done, a ``progress`` line) and its
condition ``ModelCached``; ``with_model`` folds it into the InferenceService's status: while the model is
not there, Ready says why (reason ``ModelDownloading`` or the failure's), and a failed download is
Degraded with the failure's reason (TokenRefused for a token the Hub refuses with 401/403, ...).

Where the claim's pods may run: ReadWriteOnce is one node's at a time. On a one-node cluster, or where
every pool lands on one node (a topology-bound claim, a local volume, pins the pods there itself), it is
enough. Across nodes it needs ReadWriteMany (NFS, CephFS, EFS, Filestore, ...): with ReadWriteOnce the
pods on another node than the one the claim is attached to stay ContainerCreating (FailedAttachVolume
"Multi-Attach error") for as long as a pod on the first node uses it.
"""

from __future__ import annotations

import hashlib
import json

from pdserve import model_fetch_progress, model_source
from pdserve.operator import model_pods, naming, pod_problems, pools, workloads
from pdserve.operator.config import OperatorConfig
from pdserve.operator.status import condition

ROLE = "model-download"  # the Job pod's pdserve.io/role and pool labels
BACKOFF_LIMIT = 2  # retries of a failed download pod (a refused token fails each try the same way)
DEFAULT_ACCESS_MODE = "ReadWriteOnce"
CONDITION = "ModelCached"
PHASES = ("Pending", "Downloading", "Downloaded", "Failed")


def cache_claim(isvc: dict) -> str | None:
    """The claim the InferenceService's hf:// model is fetched once into, or None (an emptyDir per pod)."""
    return model_pods.cache_claim(isvc["spec"]["model"], isvc["metadata"]["name"])


def job_name(isvc: dict) -> str:
    """``<isvc>-model-<digest>``: digest of what the download depends on (source, endpoint, token Secret)."""
    model = isvc["spec"]["model"]
    what = {"source": model["source"], "endpoint": model.get("endpoint"), "token": model.get("tokenSecret")}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:8]
    return naming.model_download_job(isvc["metadata"]["name"], digest)


def labels(isvc: dict, config: OperatorConfig) -> dict[str, str]:
    return naming.common_labels(isvc["metadata"]["name"], ROLE, ROLE, pools.protocol_version(isvc, config))


def build_claim(isvc: dict, config: OperatorConfig) -> dict | None:
    """The claim the operator makes (``spec.model.cache.size``), or None (none, or the user's pvcName)."""
    cache = isvc["spec"]["model"].get("cache") or {}
    if cache_claim(isvc) is None or not cache.get("size"):
        return None
    spec: dict = {"accessModes": [cache.get("accessMode", DEFAULT_ACCESS_MODE)],
                  "resources": {"requests": {"storage": str(cache["size"])}}}
    if cache.get("storageClassName"):
        spec["storageClassName"] = cache["storageClassName"]
    meta = workloads.object_metadata(naming.model_cache_claim(isvc["metadata"]["name"]),
                                     isvc["metadata"].get("namespace"), labels(isvc, config))
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def build_rbac(isvc: dict, config: OperatorConfig) -> list[dict]:
    """ServiceAccount, Role, RoleBinding: the Job's pod may get and patch its own Job, nothing else."""
    name, namespace = naming.model_download_account(isvc["metadata"]["name"]), isvc["metadata"].get("namespace")
    meta = workloads.object_metadata(name, namespace, labels(isvc, config))
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": [{"apiGroups": ["batch"], "resources": ["jobs"], "resourceNames": [job_name(isvc)],
                    "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace or "default"}]},
    ]


def build_job(isvc: dict, config: OperatorConfig) -> dict:
    """The download Job: one pod at a time, the claim read-write, the token, progress into the Job."""
    spec = pools.shared_spec(isvc, config, {})  # the image, pull policy and secrets every pod has
    source = model_source.parse(spec["model"]["source"])
    job, job_labels = job_name(isvc), labels(isvc, config)
    container = {
        "name": model_pods.INIT_CONTAINER,
        "image": spec["image"],
        "command": ["pdserve"],
        "args": ["fetch-model", source.text, "--dest", model_pods.download_dir(source), "--progress-job", job],
        "env": [*model_pods.fetch_env(spec["model"]),
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": model_pods.CACHE_VOLUME, "mountPath": model_pods.CACHE_MOUNT}],
        "securityContext": workloads.container_security(),
        "terminationMessagePolicy": workloads.TERMINATION_MESSAGE_POLICY,
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    pod_spec = {
        "restartPolicy": "Never",
        "serviceAccountName": naming.model_download_account(isvc["metadata"]["name"]),
        "automountServiceAccountToken": True,
        "securityContext": workloads.pod_security(),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}},
                    {"name": model_pods.CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache_claim(isvc)}}],
    }
    if spec.get("imagePullSecrets"):
        pod_spec["imagePullSecrets"] = spec["imagePullSecrets"]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": workloads.object_metadata(job, isvc["metadata"].get("namespace"), job_labels),
            "spec": {"backoffLimit": BACKOFF_LIMIT,
                     "template": {"metadata": {"labels": job_labels}, "spec": pod_spec}}}


def build(isvc: dict, config: OperatorConfig) -> list[dict]:
    """What the download needs, in creation order, except the claim (``build_claim``: created once)."""
    return [*build_rbac(isvc, config), build_job(isvc, config)] if cache_claim(isvc) else []


def stale_jobs(isvc: dict, jobs: list[dict]) -> list[str]:
    """Download Jobs of this InferenceService other than the current one (a changed source, or no claim cache)."""
    current = job_name(isvc) if cache_claim(isvc) else None
    return [j["metadata"]["name"] for j in jobs if j["metadata"]["name"] != current]


def selector(isvc_name: str) -> dict[str, str]:
    """The labels of the download Jobs and their pods."""
    return naming.selector_labels(isvc_name, ROLE, ROLE)


def _job_condition(job: dict, type_: str) -> dict | None:
    return next((c for c in (job.get("status") or {}).get("conditions") or []
                 if c.get("type") == type_ and c.get("status") == "True"), None)


def _annotation(job: dict) -> dict:
    text = ((job.get("metadata") or {}).get("annotations") or {}).get(model_fetch_progress.ANNOTATION)
    try:
        found = json.loads(text) if text else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def progress_line(counts: dict) -> str:
    """"37% (1.20 of 3.20 GiB, 3/7 files)" (GiB, MiB or KiB by the total); "" before the Job's pod said anything."""
    if not counts:
        return ""
    total = int(counts.get("bytesTotal") or 0)
    done = int(counts.get("bytesDone") or 0)
    share = f"{100 * done // total}% " if total else ""
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20)) if total >= s), ("KiB", 2**10))
    return (f"{share}({done / scale:.2f} of {total / scale:.2f} {unit}, "
            f"{counts.get('filesDone', 0)}/{counts.get('filesTotal', 0)} files)")


def model_status(isvc: dict, job: dict | None, pods: list[dict]) -> dict | None:
    """``status.model`` (see the module docstring), or None without a claim cache. ``pods``: the Job's pods."""
    claim = cache_claim(isvc)
    if claim is None:
        return None
    out = {"source": isvc["spec"]["model"]["source"], "claim": claim, "job": job_name(isvc)}
    if job is None:
        return {**out, "phase": "Pending", "reason": "JobMissing", "message": "creating the download Job"}
    note = _annotation(job)
    counts = {k: int(note[k]) for k in ("bytesDone", "bytesTotal", "filesDone", "filesTotal") if k in note}
    out.update(counts)
    problem = pod_problems.pool_problem(pods)
    if _job_condition(job, "Complete") or note.get("phase") == "Downloaded":  # the pod's word: Complete follows
        return {**out, "phase": "Downloaded", "reason": "Downloaded", "progress": progress_line(counts),
                "message": f"downloaded into claim {claim}" + (f": {progress_line(counts)}" if counts else "")}
    failed = _job_condition(job, "Failed")
    if note.get("phase") == "Failed" or failed:
        reason = note.get("reason") or "DownloadFailed"
        line = note.get("message") or (problem.message if problem else None) or (failed or {}).get("message", "")
        retry = (f"; the Job gave up: fix it, then kubectl delete job {out['job']} (the operator makes it again)"
                 if failed else "; the Job tries again")
        return {**out, "phase": "Failed", "reason": reason, "message": line + retry}
    if note.get("phase") == "Downloading":
        return {**out, "phase": "Downloading", "reason": "Downloading", "progress": progress_line(counts),
                "message": f"downloading {out['source']} into claim {claim}: {progress_line(counts)}"}
    if problem is not None:
        return {**out, "phase": "Pending", "reason": problem.reason, "message": problem.message}
    return {**out, "phase": "Pending", "reason": "Starting", "message": f"the download Job {out['job']} is starting"}


def with_model(isvc_status: dict, model: dict | None, generation: int | None) -> dict:
    """The InferenceService's status with ``status.model`` and the ModelCached condition; while the model is
    not downloaded, a not-Ready condition names the download; a failed download is Degraded. A download longer
    than the Deployments' progress deadline (600 s) is not Degraded ProgressDeadlineExceeded (the pools, whose
    pods wait for it, still say so)."""
    if model is None:  # no claim cache (perhaps no longer): remove what an earlier status had
        return {**isvc_status, "model": None}
    done = model["phase"] == "Downloaded"
    cached = condition(CONDITION, done, model["reason"], model["message"], generation)
    conditions = []
    for cond in isvc_status["conditions"]:
        if cond["type"] == "Ready" and cond["status"] == "False" and not done:
            cond = condition("Ready", False, "ModelDownloading" if model["phase"] != "Failed" else model["reason"],
                             f"model: {model['message']}", generation)
        elif cond["type"] == "Degraded" and model["phase"] == "Failed":
            cond = condition("Degraded", True, model["reason"], f"model download: {model['message']}", generation)
        elif cond["type"] == "Degraded" and cond.get("reason") == "ProgressDeadlineExceeded" and not done:
            cond = condition("Degraded", False, "ModelDownloading", f"pods wait for the model: {model['message']}",
                             generation)
        conditions.append(cond)
    return {**isvc_status, "model": model, "conditions": [*conditions, cached]}
