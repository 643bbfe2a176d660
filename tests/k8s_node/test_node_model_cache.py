"""An hf:// model fetched once for six pods, on a node where pods run (issue 48, item 3).

A local Hub (harness/hf_hub_server.py) on the node's IP stands in for huggingface.co, with a token check,
and counts the file bytes it sends. Two PersistentVolumes (hostPath, a StorageClass name no provisioner
serves, so that the claims bind to them) stand in for the cluster's storage.

- `once` (spec.model.cache.size on that class; 2 prefill pods, two decode pools of 2, a router): the
  operator's one download Job fills the claim; the six server pods mount it read-only, wait for the Job
  (init container wait-model), load the model and serve a completion through the router. The Hub sent
  exactly one copy of the model: its bytes equal the files' sizes, and each file was fetched once.
  status.model says Downloaded with those bytes.
- `refused` (a Secret with a wrong token): the Job's pod is refused (401); the InferenceService shows
  Degraded with reason TokenRefused and fetch-model's line, status.model Failed; its pods wait, none crashes,
  and the Hub sent no file.

Uses the `chart` fixture only (not the example InferenceService), in its own namespace.
"""

from __future__ import annotations

import fnmatch
import json
import os

import pytest
import yaml

from harness import node_serving
from harness.hf_hub_server import HubServer, write_tiny_checkpoint
from harness.operator_harness import condition, get_json
from pdserve import defaults, model_fetch
from pdserve.operator import naming

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NAMESPACE = "model-cache"
TOKEN = "hf_node_cache_token"
REPO_ID = "acme/tiny"
STORAGE_CLASS = "pdserve-node-model"  # no StorageClass object: claims of it bind to the PVs below
REQUEST = {"requests": {"cpu": node_serving.CPU_REQUEST}}


def cached_isvc(name: str, secret: str, endpoint: str) -> dict:
    return {
        "apiVersion": naming.API_VERSION, "kind": "InferenceService", "metadata": {"name": name},
        "spec": {
            "model": {"source": f"hf://{REPO_ID}", "tokenSecret": {"name": secret}, "endpoint": endpoint,
                      "cache": {"size": "1Gi", "storageClassName": STORAGE_CLASS}},
            "prefill": {"replicas": 2, "resources": REQUEST},
            "router": {"replicas": 1, "resources": REQUEST},
            "decode": [{"name": "a", "replicas": 2, "resources": REQUEST},
                       {"name": "b", "replicas": 2, "resources": REQUEST}],
        },
    }


def host_volume(name: str, path) -> dict:
    path.mkdir(parents=True)
    os.chmod(path, 0o777)  # the pods run as uid 10001; fsGroup does not apply to hostPath
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": STORAGE_CLASS,
                     "hostPath": {"path": str(path), "type": "Directory"}}}


@pytest.fixture(scope="module")
def hub(node_kube, tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("hub") / "tiny")
    volumes = [host_volume(f"pdserve-model-cache-{i}", tmp_path_factory.mktemp("pv") / "disk") for i in (1, 2)]
    with HubServer({REPO_ID: folder}, token=TOKEN, host="0.0.0.0", advertise=node_kube.node_ip) as server:
        node_kube.kubectl("create", "namespace", NAMESPACE)
        for name, token in (("hf-good", TOKEN), ("hf-bad", "hf_wrong")):
            node_kube.kubectl("create", "secret", "generic", name, "-n", NAMESPACE, f"--from-literal=HF_TOKEN={token}")
        node_kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(volumes))
        try:
            yield server
        finally:
            node_kube.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
            for volume in volumes:
                node_kube.kubectl("delete", "pv", volume["metadata"]["name"], "--wait=false", check=False)


def one_copy(hub: HubServer) -> dict[str, int]:
    """The files of the served repository fetch-model downloads (what the engine reads) and their sizes."""
    folder = hub.repos[REPO_ID]
    patterns = model_fetch.allow_patterns(tokenizer_only=False)
    return {p.name: p.stat().st_size for p in folder.iterdir()
            if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)}


def status_of(node_kube, name: str) -> dict:
    return (get_json(node_kube, "inferenceservice", name, "-n", NAMESPACE) or {}).get("status") or {}


def test_six_pods_of_one_inference_service_download_the_model_once(node_kube, chart, hub):
    doc = cached_isvc("once", "hf-good", hub.url)
    node_kube.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(doc))

    def all_ready() -> bool:
        s = status_of(node_kube, "once")
        return s.get("prefillReady") == "2/2" and s.get("decodeReady") == "4/4" and s.get("routerReady") == "1/1"

    try:
        node_kube.wait_until(all_ready, node_serving.READY_TIMEOUT_S, 1.0, "2 prefill, 4 decode and 1 router pod Ready")
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{node_serving.describe(node_kube, NAMESPACE)}\n"
                           f"{json.dumps(status_of(node_kube, 'once'), indent=1)}") from None

    files = one_copy(hub)
    gets = [p for m, p in hub.requests if m == "GET" and "/resolve/" in p]
    assert sorted(p.rsplit("/", 1)[1] for p in gets) == sorted(files), hub.requests  # each file once
    assert hub.bytes_served == sum(files.values()), (hub.bytes_served, files)  # one copy, for 7 pods
    print(f"\nHub sent {hub.bytes_served} bytes for 6 server pods and a router; one copy is {sum(files.values())}")

    servers = node_kube.pods(NAMESPACE, "pdserve.io/inference-service=once,pdserve.io/role in (prefill,decode)")
    assert len(servers) == 6
    for pod in servers:  # each waited for the Job, downloaded nothing itself, and mounts the claim read-only
        (init,) = pod["status"]["initContainerStatuses"]
        assert init["name"] == "wait-model" and init["state"]["terminated"]["exitCode"] == 0, init
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model-cache")
        assert volume["persistentVolumeClaim"] == {"claimName": "once-model-cache", "readOnly": True}
    model = status_of(node_kube, "once")["model"]
    assert model["phase"] == "Downloaded" and model["bytesDone"] == model["bytesTotal"] == sum(files.values()), model
    assert model["filesDone"] == model["filesTotal"] == len(files), model
    (job,) = json.loads(node_kube.kubectl("get", "jobs", "-n", NAMESPACE, "-l", "pdserve.io/inference-service=once",
                                          "-o", "json").stdout)["items"]
    assert job["status"].get("succeeded") == 1, job["status"]

    service = status_of(node_kube, "once")["endpoint"].split("//", 1)[1].split(".", 1)[0]
    base_url = f"http://{node_kube.cluster_ip(NAMESPACE, service)}:{defaults.HTTP_PORT}/v1"
    assert node_serving.first_model(base_url) == "tiny"
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    completion = client.completions.create(model="tiny", prompt="hello world the cat", max_tokens=6,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 6, completion
    assert hub.bytes_served == sum(files.values())  # serving fetched nothing more


def test_a_refused_token_shows_on_the_inference_service_and_the_pods_wait(node_kube, chart, hub):
    before = hub.bytes_served
    doc = cached_isvc("refused", "hf-bad", hub.url)
    doc["spec"]["prefill"]["replicas"] = 1
    doc["spec"]["decode"] = [{"name": "a", "replicas": 1, "resources": REQUEST}]
    node_kube.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(doc))

    def degraded() -> dict | None:
        cond = condition(get_json(node_kube, "inferenceservice", "refused", "-n", NAMESPACE), "Degraded")
        return cond if cond and cond["status"] == "True" and cond["reason"] == "TokenRefused" else None

    try:
        node_kube.wait_until(lambda: degraded() is not None, 300, 1.0, "refused: Degraded TokenRefused")
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{node_serving.describe(node_kube, NAMESPACE)}\n"
                           f"{json.dumps(status_of(node_kube, 'refused'), indent=1)}") from None
    cond = degraded()
    assert f"token refused (401) for {REPO_ID}@main at {hub.url}" in cond["message"], cond
    assert "spec.model.tokenSecret" in cond["message"], cond
    isvc = get_json(node_kube, "inferenceservice", "refused", "-n", NAMESPACE)
    assert condition(isvc, "ModelCached")["status"] == "False"
    assert isvc["status"]["model"]["phase"] == "Failed" and isvc["status"]["model"]["reason"] == "TokenRefused"
    assert condition(isvc, "Ready")["status"] == "False"
    for pod in node_kube.pods(NAMESPACE, "pdserve.io/inference-service=refused,pdserve.io/role in (prefill,decode)"):
        for init in pod["status"].get("initContainerStatuses") or []:  # waiting, not failing
            assert "terminated" not in init["state"], init
    assert hub.bytes_served == before  # the Hub sent no file
