"""spec.model.cache on a claim (operator/model_cache.py): the claim, the download Job and its RBAC, the pods'
wait, and status.model / ModelCached from the Job, its annotation and its pods."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdserve import model_fetch_progress
from pdserve.operator import model_cache, pools, router_workloads, status, workloads
from pdserve.operator.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = OperatorConfig(default_image="registry.local/pdserve:1", protocol_version="7")
SOURCE = "hf://meta-llama/Llama-3.1-8B-Instruct"


def isvc(**cache) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    doc["metadata"].update(namespace="ns1", generation=3)
    doc["spec"]["model"] = {"source": SOURCE, "tokenSecret": {"name": "hf", "key": "HF_TOKEN"}, "cache": cache}
    return doc


def job(annotation: dict | None = None, condition: str | None = None, message: str = "") -> dict:
    meta: dict = {"name": "chat-model-x", "annotations": {}}
    if annotation is not None:
        meta["annotations"][model_fetch_progress.ANNOTATION] = json.dumps(annotation)
    conditions = [{"type": condition, "status": "True", "message": message}] if condition else []
    return {"metadata": meta, "status": {"conditions": conditions}}


def test_size_makes_a_claim_a_job_and_rbac_for_its_own_job_only():
    doc = isvc(size="40Gi", storageClassName="fast", accessMode="ReadWriteMany")
    claim = model_cache.build_claim(doc, CONFIG)
    assert claim["metadata"]["name"] == "chat-model-cache" and claim["metadata"]["namespace"] == "ns1"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "40Gi"}},
                             "storageClassName": "fast"}
    account, role, binding, download = model_cache.build(doc, CONFIG)
    name = model_cache.job_name(doc)
    assert name.startswith("chat-model-") and len(name) <= 63
    assert role["rules"] == [{"apiGroups": ["batch"], "resources": ["jobs"], "resourceNames": [name],
                              "verbs": ["get", "patch"]}]
    assert binding["subjects"][0]["name"] == account["metadata"]["name"] == "chat-model-download"
    pod = download["spec"]["template"]["spec"]
    assert download["metadata"]["name"] == name and download["spec"]["backoffLimit"] == model_cache.BACKOFF_LIMIT
    assert pod["serviceAccountName"] == "chat-model-download" and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["args"] == ["fetch-model", SOURCE, "--dest", "/model-cache/meta-llama/Llama-3.1-8B-Instruct/main",
                                 "--progress-job", name]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
    assert "POD_NAMESPACE" in env
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "chat-model-cache"}} in pod["volumes"]
    assert {"name": "model-cache", "mountPath": "/model-cache"} in container["volumeMounts"]  # read-write
    labels = download["spec"]["template"]["metadata"]["labels"]
    assert labels["pdserve.io/role"] == "model-download" and labels["pdserve.io/inference-service"] == "chat"


def test_a_claim_of_the_user_gets_a_job_and_no_claim_and_access_mode_defaults_to_rwo():
    doc = isvc(pvcName="weights")
    assert model_cache.build_claim(doc, CONFIG) is None
    *_, download = model_cache.build(doc, CONFIG)
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "weights"}} in \
        download["spec"]["template"]["spec"]["volumes"]
    assert model_cache.build_claim(isvc(size="1Gi"), CONFIG)["spec"]["accessModes"] == ["ReadWriteOnce"]


@pytest.mark.parametrize("cache", [{}, {"sizeLimit": "8Gi"}])
def test_an_emptydir_cache_has_no_job_and_its_old_jobs_are_stale(cache):
    doc = isvc(**cache)
    assert model_cache.build(doc, CONFIG) == [] and model_cache.build_claim(doc, CONFIG) is None
    assert model_cache.stale_jobs(doc, [{"metadata": {"name": "chat-model-0badf00d"}}]) == ["chat-model-0badf00d"]
    assert model_cache.model_status(doc, None, []) is None


def test_a_new_source_endpoint_or_secret_is_a_new_job_and_the_old_one_is_stale():
    doc = isvc(size="1Gi")
    first = model_cache.job_name(doc)
    for change in ({"source": SOURCE + "@v2"}, {"endpoint": "http://mirror:8080"}, {"tokenSecret": {"name": "hf2"}}):
        changed = isvc(size="1Gi")
        changed["spec"]["model"].update(change)
        assert model_cache.job_name(changed) != first, change
    same = isvc(size="2Gi")  # the claim's size is not the download's
    assert model_cache.job_name(same) == first
    assert model_cache.stale_jobs(doc, [{"metadata": {"name": first}}, {"metadata": {"name": "chat-model-1"}}]) == \
        ["chat-model-1"]


def test_every_server_pod_mounts_the_claim_read_only_and_waits_and_the_router_reads_from_a_prefill():
    doc = isvc(size="1Gi")
    deployments = [workloads.build_deployment(pools.build_prefill_pool(doc, CONFIG)),
                   *[workloads.build_deployment(p) for p in pools.build_decode_pools(doc, CONFIG)]]
    for deployment in deployments:
        spec = deployment["spec"]["template"]["spec"]
        (wait,) = spec["initContainers"]
        assert wait["name"] == "wait-model"
        assert wait["args"] == ["fetch-model", SOURCE, "--dest", "/model-cache/meta-llama/Llama-3.1-8B-Instruct/main",
                                "--wait"]
        assert all(m.get("readOnly") for m in wait["volumeMounts"] if m["name"] == "model-cache")
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "chat-model-cache", "readOnly": True}} \
            in spec["volumes"]
    router = router_workloads.build_router_deployment(doc, CONFIG)["spec"]["template"]["spec"]
    assert "initContainers" not in router and "--tokenizer-from-prefill" in router["containers"][0]["args"]


def test_status_follows_the_job_from_pending_to_downloading_to_downloaded():
    doc = isvc(size="1Gi")
    assert model_cache.model_status(doc, None, [])["reason"] == "JobMissing"
    assert model_cache.model_status(doc, job(), [])["phase"] == "Pending"
    counts = {"bytesDone": 3 * 2**29, "bytesTotal": 2**31, "filesDone": 1, "filesTotal": 4}
    going = model_cache.model_status(doc, job({"phase": "Downloading", **counts}), [])
    assert going["phase"] == "Downloading" and going["bytesDone"] == 3 * 2**29 and going["filesTotal"] == 4
    assert going["progress"] == "75% (1.50 of 2.00 GiB, 1/4 files)"
    small = model_cache.progress_line({"bytesDone": 94242, "bytesTotal": 94242, "filesDone": 5, "filesTotal": 5})
    assert small == "100% (92.03 of 92.03 KiB, 5/5 files)"
    done = model_cache.model_status(doc, job({"phase": "Downloaded", **counts}, "Complete"), [])
    assert done["phase"] == "Downloaded" and done["claim"] == "chat-model-cache"


def test_a_refused_token_is_failed_with_its_reason_and_says_how_to_retry_once_the_job_gave_up():
    doc = isvc(size="1Gi")
    line = "token refused (401) for meta-llama/Llama-3.1-8B-Instruct@main at https://huggingface.co: put a valid token"
    trying = model_cache.model_status(doc, job({"phase": "Failed", "reason": "TokenRefused", "message": line}), [])
    assert trying["phase"] == "Failed" and trying["reason"] == "TokenRefused" and line in trying["message"]
    assert "tries again" in trying["message"]
    gave_up = model_cache.model_status(
        doc, job({"phase": "Failed", "reason": "TokenRefused", "message": line}, "Failed", "BackoffLimitExceeded"), [])
    assert f"kubectl delete job {model_cache.job_name(doc)}" in gave_up["message"]
    # no annotation (the pod could not write it): the Job's own failure
    bare = model_cache.model_status(doc, job(None, "Failed", "Job has reached the specified backoff limit"), [])
    assert bare["reason"] == "DownloadFailed" and "backoff limit" in bare["message"]


def test_a_download_pod_that_cannot_start_names_why():
    doc = isvc(size="1Gi")
    pod = {"metadata": {"name": "chat-model-x-abc", "labels": model_cache.selector("chat")},
           "status": {"phase": "Pending", "conditions": [{
               "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
               "message": "pod has unbound immediate PersistentVolumeClaims"}]}}
    pending = model_cache.model_status(doc, job(), [pod])
    assert pending["phase"] == "Pending" and pending["reason"] == "Unschedulable"
    assert "unbound immediate PersistentVolumeClaims" in pending["message"]


def _isvc_status(ready: bool) -> dict:
    return {"conditions": [status.condition("Ready", ready, "Serving" if ready else "PrefillNotReady", "", 3),
                           status.condition("Progressing", False, "Stable", "", 3),
                           status.condition("Degraded", False, "AsExpected", "", 3)]}


def test_with_model_names_the_download_on_ready_and_a_failure_on_degraded():
    doc = isvc(size="1Gi")
    going = model_cache.model_status(doc, job({"phase": "Downloading", "bytesDone": 1, "bytesTotal": 4}), [])
    merged = model_cache.with_model(_isvc_status(False), going, 3)
    conds = {c["type"]: c for c in merged["conditions"]}
    assert conds["Ready"]["reason"] == "ModelDownloading" and "25%" in conds["Ready"]["message"]
    assert conds["ModelCached"]["status"] == "False" and conds["Degraded"]["status"] == "False"
    assert merged["model"]["phase"] == "Downloading"
    failed = model_cache.model_status(doc, job({"phase": "Failed", "reason": "TokenRefused", "message": "no"}), [])
    conds = {c["type"]: c for c in model_cache.with_model(_isvc_status(False), failed, 3)["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "TokenRefused"
    assert conds["Ready"]["reason"] == "TokenRefused"
    done = model_cache.model_status(doc, job({"phase": "Downloaded"}, "Complete"), [])
    conds = {c["type"]: c for c in model_cache.with_model(_isvc_status(True), done, 3)["conditions"]}
    assert conds["Ready"]["reason"] == "Serving" and conds["ModelCached"]["status"] == "True"
    assert model_cache.with_model(_isvc_status(True), None, 3)["model"] is None  # removed (merge patch)
    # a download longer than the Deployments' progress deadline is not a degraded service
    late = _isvc_status(False)
    late["conditions"][2] = status.condition("Degraded", True, "ProgressDeadlineExceeded", "prefill: ...", 3)
    conds = {c["type"]: c for c in model_cache.with_model(late, going, 3)["conditions"]}
    assert conds["Degraded"]["status"] == "False" and conds["Degraded"]["reason"] == "ModelDownloading"
    bare = model_cache.model_status(doc, job(None, "Complete"), [])
    assert bare["message"] == "downloaded into claim chat-model-cache"
