"""The user's path on a cluster where pods run (tests/harness/kube_node.py): `helm install` the chart
with the image built from the Dockerfile, `kubectl apply` examples/inferenceservice.yaml, wait for
Ready, stream a chat completion with the `openai` client through the InferenceService's Service, then
`helm test` (the chart's test pod sends one completion through it from inside the cluster).

The `chat` fixture (conftest.py) does the steps and times them; the figures are printed (run with
-s to see them): apply -> Ready and apply -> first streamed token.
"""

import json

import pytest

from harness import node_serving
from harness.operator_harness import get_json
from harness.pd_cluster import get_json as http_json
from harness.pd_cluster import nothing_held, wait_all_released

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def test_helm_apply_example_and_stream_through_the_service(node_kube, chat, capsys):
    with capsys.disabled():
        print(f"\nuser path (s): {json.dumps({k: round(v, 1) for k, v in chat.timings.items()})}; "
              f"image {node_kube.image}; first answer: {chat.first_text!r}")
    assert chat.timings["apply_to_first_token_s"] >= chat.timings["apply_to_ready_s"] > 0

    # What runs is what the chart and the operator made, from the built image, in real pods.
    ns = chat.namespace
    pods = node_kube.pods(ns, "pdserve.io/inference-service=chat")
    roles = sorted(p["metadata"]["labels"]["pdserve.io/role"] + "/" + p["metadata"]["labels"]["pdserve.io/pool"]
                   for p in pods if p["status"].get("phase") == "Running")
    assert roles == ["decode/big", "decode/main", "decode/main", "prefill/prefill", "router/router"], roles
    assert {c["image"] for p in pods for c in p["spec"]["containers"]} == {node_kube.image}
    operator = node_kube.pods(node_serving.RELEASE_NAMESPACE, "app.kubernetes.io/component=operator")
    assert [p["status"]["phase"] for p in operator] == ["Running"]
    assert operator[0]["spec"]["containers"][0]["image"] == node_kube.image

    status = get_json(node_kube, "inferenceservice", "chat", "-n", ns)["status"]
    assert status["prefillReady"] == "1/1" and status["decodeReady"] == "3/3" and status["routerReady"] == "1/1", status

    # Prefill found its decodes through EndpointSlices from inside its pod, with its ServiceAccount
    # token (RBAC for real): every decode pod's address is routable from the prefill.
    (prefill,) = node_serving.pod_servers(node_kube, ns, "prefill")
    decodes = node_serving.pod_servers(node_kube, ns, "decode")
    routable = http_json(prefill.url + "/health")[1]["routable_decodes"]
    assert sorted(a.rsplit(":", 1)[0] for a in routable) == sorted(d.ip for d in decodes), (routable, decodes)

    # A second stream through the Service works, and afterwards nothing is held anywhere.
    _, text, finish = node_serving.stream_chat(chat.base_url, chat.model, "And once more.", max_tokens=8,
                                               ignore_eos=True)
    assert text and finish == "length", (text, finish)
    readings = wait_all_released([prefill, *decodes])
    assert nothing_held(readings), readings

    # `helm test`: the chart's test pod, in the release's namespace, sends one completion through the
    # same Service from inside the cluster (by its ClusterIP: this node runs no cluster DNS)
    out = node_serving.helm_test(node_kube, chat.base_url.removesuffix("/v1"))
    assert "Succeeded" in out and f"model {chat.model!r} answered" in out, out
