"""An hf:// model on a node where pods run: the user's model downloaded by each pod's init container.

A local Hub (harness/hf_hub_server.py) serves a tiny checkpoint (acme/tiny) on the node's IP with a
token check; InferenceServices point spec.model.endpoint at it:

- `good` (tokenSecret: a Secret with the right token): Ready, /v1/models lists "tiny" (the
  repository's name), and a completion streams through the router's Service;
- `bad` (a Secret with a wrong token): its pods never start; the pools' Degraded condition says
  InitContainerFailed with fetch-model's one line ("token refused (401) for acme/tiny@main ...").

Uses the `chart` fixture only (not the example InferenceService), in its own namespace.
"""

from __future__ import annotations

import json

import pytest
import yaml

from harness import node_serving
from harness.hf_hub_server import HubServer, write_tiny_checkpoint
from harness.operator_harness import condition, get_json
from pdserve import defaults
from pdserve.operator import naming

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NAMESPACE = "hf-model"
TOKEN = "hf_node_test_token"
REPO_ID = "acme/tiny"


def hf_isvc(name: str, secret: str, endpoint: str) -> dict:
    return {
        "apiVersion": naming.API_VERSION, "kind": "InferenceService", "metadata": {"name": name},
        "spec": {
            "model": {"source": f"hf://{REPO_ID}", "tokenSecret": {"name": secret}, "endpoint": endpoint,
                      "cache": {"sizeLimit": "1Gi"}},
            "prefill": {"replicas": 1, "resources": {"requests": {"cpu": node_serving.CPU_REQUEST}}},
            "router": {"replicas": 1, "resources": {"requests": {"cpu": node_serving.CPU_REQUEST}}},
            "decode": [{"name": "main", "replicas": 1,
                        "resources": {"requests": {"cpu": node_serving.CPU_REQUEST}}}],
        },
    }


@pytest.fixture(scope="module")
def hub(node_kube, tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("hub") / "tiny")
    with HubServer({REPO_ID: folder}, token=TOKEN, host="0.0.0.0", advertise=node_kube.node_ip) as server:
        node_kube.kubectl("create", "namespace", NAMESPACE)
        for name, token in (("hf-good", TOKEN), ("hf-bad", "hf_wrong")):
            node_kube.kubectl("create", "secret", "generic", name, "-n", NAMESPACE, f"--from-literal=HF_TOKEN={token}")
        try:
            yield server
        finally:
            node_kube.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def test_hf_model_is_fetched_by_each_pod_and_serves_a_completion(node_kube, chart, hub):
    doc = hf_isvc("good", "hf-good", hub.url)
    node_kube.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(doc))
    try:
        node_kube.wait_until(lambda: node_serving.isvc_ready(node_kube, NAMESPACE, "good"),
                             node_serving.READY_TIMEOUT_S, 1.0, "InferenceService hf-model/good to be Ready")
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{node_serving.describe(node_kube, NAMESPACE)}") from None

    pods = node_kube.pods(NAMESPACE, "pdserve.io/inference-service=good")
    for pod in pods:  # every pod (router included) ran the download to completion
        (init,) = pod["status"]["initContainerStatuses"]
        assert init["name"] == "fetch-model" and init["state"]["terminated"]["exitCode"] == 0, init
    # the weights were fetched by prefill and decode; the router fetched config and tokenizer only
    weight_gets = [p for m, p in hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert len(weight_gets) == 2, hub.requests

    status = get_json(node_kube, "inferenceservice", "good", "-n", NAMESPACE)["status"]
    service = status["endpoint"].split("//", 1)[1].split(".", 1)[0]
    base_url = f"http://{node_kube.cluster_ip(NAMESPACE, service)}:{defaults.HTTP_PORT}/v1"
    assert node_serving.first_model(base_url) == "tiny"  # the repository's name

    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    completion = client.completions.create(model="tiny", prompt="hello world the cat", max_tokens=6,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 6, completion


def test_wrong_token_shows_init_container_failed_with_the_message(node_kube, chart, hub):
    doc = hf_isvc("bad", "hf-bad", hub.url)
    node_kube.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(doc))
    expected = f"token refused (401) for {REPO_ID}@main at {hub.url}"

    def degraded() -> dict | None:
        pool = get_json(node_kube, "prefillpool", "bad-prefill", "-n", NAMESPACE)
        cond = condition(pool, "Degraded") if pool else None
        return cond if cond and cond["status"] == "True" and cond["reason"] == "InitContainerFailed" else None

    try:
        node_kube.wait_until(lambda: degraded() is not None, 300, 2.0, "the prefill pool Degraded: InitContainerFailed")
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{node_serving.describe(node_kube, NAMESPACE)}") from None
    cond = degraded()
    assert expected in cond["message"], cond
    assert "spec.model.tokenSecret" in cond["message"], cond
    # the InferenceService says so too, and is not Ready
    isvc = get_json(node_kube, "inferenceservice", "bad", "-n", NAMESPACE)
    assert not node_serving.isvc_ready(node_kube, NAMESPACE, "bad")
    top = condition(isvc, "Degraded")
    assert top and top["status"] == "True", json.dumps(isvc.get("status"), indent=1)
