"""spec.model.cache on a claim, on a real control plane (pods do not run here): the operator makes the claim, one
download Job and the RBAC that lets the Job's pod write its progress into that Job; every pool's pod mounts the
claim read-only and waits; `pdserve fetch-model --progress-job`, run here as the Job's pod would run it (under
the Job's ServiceAccount, against a local Hub stand-in), writes the progress the operator puts into
status.model; a refused token shows on the InferenceService as Degraded TokenRefused; a deleted Job is made
again and a changed source replaces it. The schema refuses a cache that is two things at once."""

from __future__ import annotations

import json
import subprocess

import yaml

from harness.hf_hub_server import HubServer, write_tiny_checkpoint
from harness.operator_harness import condition, get_json, names, wait_for
from harness.procs import REPO, VENV_BIN
from pdserve import model_fetch_progress
from pdserve.operator import model_cache

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
REPO_ID = "acme/tiny"
TOKEN = "hf_k8s_test_token"
DEPLOYMENTS = ["chat-decode-big", "chat-decode-main", "chat-prefill", "chat-router"]


def isvc(cache: dict, source: str = f"hf://{REPO_ID}", endpoint: str = "http://hub.example:8080") -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"] = {"source": source, "tokenSecret": {"name": "hf"}, "endpoint": endpoint, "cache": cache}
    return doc


def apply(kube, ns: str, doc: dict) -> None:
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))


def jobs(kube, ns: str) -> list[dict]:
    return json.loads(kube.kubectl("get", "jobs", "-n", ns, "-l", f"pdserve.io/role={model_cache.ROLE}",
                                   "-o", "json").stdout)["items"]


def model_of(kube, ns: str) -> dict:
    return (get_json(kube, "pdis", "chat", "-n", ns).get("status") or {}).get("model") or {}


def run_download(kube, ns: str, job: str, hub: HubServer, token: str, dest) -> subprocess.CompletedProcess:
    """The Job's container, here: its ServiceAccount's token, its namespace, its arguments."""
    kubeconfig = kube.token_kubeconfig(ns, "chat-model-download")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(dest), "HF_HOME": str(dest / "hf-home"), "HF_ENDPOINT": hub.url,
           "HF_TOKEN": token, "HF_HUB_DISABLE_TELEMETRY": "1", "POD_NAMESPACE": ns, "KUBECONFIG": str(kubeconfig)}
    return subprocess.run([str(VENV_BIN / "pdserve"), "fetch-model", f"hf://{REPO_ID}", "--dest", str(dest / "m"),
                           "--progress-job", job], capture_output=True, text=True, timeout=120, env=env)


def test_a_claim_cache_gets_one_job_and_pods_that_wait_for_it(kube, operator, ns):
    apply(kube, ns, isvc({"size": "2Gi", "storageClassName": "fast", "accessMode": "ReadWriteMany"}))
    wait_for(kube, lambda: names(kube, "deployments", ns) == DEPLOYMENTS and len(jobs(kube, ns)) == 1,
             "four Deployments and one download Job", op=operator)
    claim = get_json(kube, "pvc", "chat-model-cache", "-n", ns)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    (job,) = jobs(kube, ns)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == ["--progress-job", job["metadata"]["name"]]
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "chat-model-download"
    for deployment in DEPLOYMENTS:
        spec = get_json(kube, "deployment", deployment, "-n", ns)["spec"]["template"]["spec"]
        if deployment == "chat-router":  # no claim, no download: its tokenizer from a prefill
            assert "initContainers" not in spec and "--tokenizer-from-prefill" in spec["containers"][0]["args"]
            continue
        (wait,) = spec["initContainers"]
        assert wait["name"] == "wait-model" and wait["args"][-1] == "--wait"
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "chat-model-cache", "readOnly": True}} \
            in spec["volumes"]
    # the InferenceService says the model is not there yet, and why it is not Ready
    wait_for(kube, lambda: model_of(kube, ns).get("phase") == "Pending", "status.model Pending", op=operator)
    ready = condition(get_json(kube, "pdis", "chat", "-n", ns), "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ModelDownloading", ready


def test_the_jobs_progress_reaches_status_and_a_refused_token_is_degraded(kube, operator, ns, tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "hub" / "tiny")
    apply(kube, ns, isvc({"size": "1Gi"}))
    wait_for(kube, lambda: len(jobs(kube, ns)) == 1, "the download Job", op=operator)
    job = jobs(kube, ns)[0]["metadata"]["name"]
    with HubServer({REPO_ID: folder}, token=TOKEN) as hub:
        refused = run_download(kube, ns, job, hub, "hf_wrong", tmp_path / "bad")
        assert refused.returncode == 1, refused.stderr
        assert "cannot write progress" not in refused.stderr  # its ServiceAccount may patch its own Job
        wait_for(kube, lambda: model_of(kube, ns).get("reason") == "TokenRefused", "status.model TokenRefused",
                 op=operator)
        isvc_now = get_json(kube, "pdis", "chat", "-n", ns)
        degraded = condition(isvc_now, "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "TokenRefused", degraded
        assert f"token refused (401) for {REPO_ID}@main at {hub.url}" in degraded["message"]
        assert condition(isvc_now, "ModelCached")["status"] == "False"
        assert condition(isvc_now, "Ready")["reason"] == "TokenRefused"

        done = run_download(kube, ns, job, hub, TOKEN, tmp_path / "good")  # the Job's next try, the token fixed
        assert done.returncode == 0, done.stderr
    annotation = json.loads(get_json(kube, "job", job, "-n", ns)["metadata"]["annotations"]
                            [model_fetch_progress.ANNOTATION])
    size = sum(p.stat().st_size for p in folder.iterdir() if p.name != "README.md")
    assert annotation == {"phase": "Downloaded", "bytesDone": size, "bytesTotal": size, "filesDone": 5,
                          "filesTotal": 5}, annotation
    assert (tmp_path / "good" / "m" / model_fetch_progress.MARKER).is_file()
    wait_for(kube, lambda: model_of(kube, ns).get("phase") == "Downloaded", "status.model Downloaded", op=operator)
    model = model_of(kube, ns)
    assert model["bytesDone"] == model["bytesTotal"] == size and model["filesDone"] == 5 and model["job"] == job
    isvc_now = get_json(kube, "pdis", "chat", "-n", ns)
    assert condition(isvc_now, "ModelCached")["status"] == "True"
    assert condition(isvc_now, "Degraded")["reason"] != "TokenRefused"


def test_a_deleted_job_is_made_again_and_a_new_source_replaces_it(kube, operator, ns):
    apply(kube, ns, isvc({"pvcName": "mine"}))
    wait_for(kube, lambda: len(jobs(kube, ns)) == 1, "the download Job", op=operator)
    assert get_json(kube, "pvc", "chat-model-cache", "-n", ns) is None  # the user's claim: none made
    first = jobs(kube, ns)[0]
    kube.kubectl("delete", "job", first["metadata"]["name"], "-n", ns, "--wait=true")
    wait_for(kube, lambda: [j["metadata"]["uid"] for j in jobs(kube, ns)] not in ([], [first["metadata"]["uid"]]),
             "the Job made again", op=operator)
    assert [j["metadata"]["name"] for j in jobs(kube, ns)] == [first["metadata"]["name"]]
    apply(kube, ns, isvc({"pvcName": "mine"}, source=f"hf://{REPO_ID}@v2"))
    wait_for(kube, lambda: [j["metadata"]["name"] for j in jobs(kube, ns)
                            if not j["metadata"].get("deletionTimestamp")] not in ([], [first["metadata"]["name"]]),
             "a new Job for the new source, the old one gone", op=operator)
    (now,) = [j for j in jobs(kube, ns) if not j["metadata"].get("deletionTimestamp")]
    assert "hf://acme/tiny@v2" in now["spec"]["template"]["spec"]["containers"][0]["args"]
    role = get_json(kube, "role", "chat-model-download", "-n", ns)
    assert role["rules"][0]["resourceNames"] == [now["metadata"]["name"]]
    # back to an emptyDir: no Job
    apply(kube, ns, isvc({"sizeLimit": "1Gi"}))
    wait_for(kube, lambda: not [j for j in jobs(kube, ns) if not j["metadata"].get("deletionTimestamp")],
             "the download Job deleted", op=operator)
    wait_for(kube, lambda: "model" not in (get_json(kube, "pdis", "chat", "-n", ns).get("status") or {}),
             "status.model removed", op=operator)


def test_a_cache_that_is_two_things_is_refused_naming_the_fields(kube, ns):
    for cache, words in (({"size": "1Gi", "pvcName": "mine"}, "set one of sizeLimit"),
                         ({"sizeLimit": "1Gi", "size": "1Gi"}, "set one of sizeLimit"),
                         ({"pvcName": "mine", "storageClassName": "fast"}, "only for a claim the operator makes"),
                         ({"size": "1Gi", "accessMode": "ReadWriteOncePod"}, "accessMode")):
        out = kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(isvc(cache)), check=False)
        assert out.returncode != 0 and words in out.stderr, (cache, out.stderr)
