"""Readiness gates on real pods (the `chat` InferenceService, conftest.py): a prefill pod is Ready
only while it can reach a decode. Every decode pool scaled to 0: the prefill's /ready answers 503
naming why, the kubelet's readiness probe takes the pod out of its Service (Ready=False, the pod
is not restarted), the InferenceService's status says so, and the Service does not serve. The pools
back: the same prefill pod is Ready again and serves.
"""

from __future__ import annotations

import pytest

from harness import node_serving
from harness.operator_harness import get_json
from harness.pd_cluster import get_json as http_json
from harness.pd_cluster import nothing_held, wait_all_released
from pdserve import defaults

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def _pod_ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _prefill_pod(kube, ns: str) -> dict:
    pods = [p for p in kube.pods(ns, "pdserve.io/role=prefill") if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


def _scale_pools(kube, ns: str, counts: dict[str, int]) -> None:
    for pool, replicas in counts.items():
        kube.kubectl("scale", f"decodepool/chat-decode-{pool}", "-n", ns, f"--replicas={replicas}")


def test_prefill_is_ready_only_with_a_reachable_decode(node_kube, chat, capsys):
    import openai

    kube, ns = node_kube, chat.namespace
    pools = {}
    for pod in kube.pods(ns, "pdserve.io/role=decode"):
        pool = pod["metadata"]["labels"]["pdserve.io/pool"]
        pools[pool] = pools.get(pool, 0) + 1
    before = _prefill_pod(kube, ns)
    assert _pod_ready(before)
    name, ip = before["metadata"]["name"], before["status"]["podIP"]
    restarts = before["status"]["containerStatuses"][0]["restartCount"]
    prefill_url = f"http://{ip}:{defaults.HTTP_PORT}"

    _scale_pools(kube, ns, {pool: 0 for pool in pools})
    try:
        kube.wait_until(lambda: kube.pods(ns, "pdserve.io/role=decode") == [], 180, 1, "every decode pod to be gone")
        _, body = kube.wait_until(lambda: (lambda r: r if r[0] == 503 else None)(http_json(prefill_url + "/ready")),
                                       60, 0.5, "the prefill's /ready to answer 503")
        assert body["ready"] is False and "decode" in body["reason"], body
        kube.wait_until(lambda: not _pod_ready(_prefill_pod(kube, ns)), 60, 1, "the prefill pod to be NotReady")
        kube.wait_until(lambda: get_json(kube, "inferenceservice", "chat", "-n", ns)["status"].get(
            "prefillReady") == "0/1", 60, 1, "the InferenceService's status to count 0/1 ready prefills")
        assert not node_serving.isvc_ready(kube, ns, "chat")
        with pytest.raises(openai.APIError):          # the Service does not serve (503, or no endpoint at all)
            node_serving.stream_chat(chat.base_url, chat.model, "is anyone there?", max_tokens=4, timeout=30)
    finally:
        _scale_pools(kube, ns, pools)
    kube.wait_until(lambda: _pod_ready(_prefill_pod(kube, ns)), 300, 1, "the prefill pod to be Ready again")
    kube.wait_until(lambda: node_serving.isvc_ready(kube, ns, "chat"), 300, 1, "the InferenceService to be Ready again")
    after = _prefill_pod(kube, ns)
    assert after["metadata"]["name"] == name, "the prefill pod was replaced: readiness must not restart it"
    assert after["status"]["containerStatuses"][0]["restartCount"] == restarts
    # the router's Service serves again, through the same prefill pod
    _, text, finish = kube.wait_until(lambda: _try_stream(chat), 120, 2, "a stream through the Service")
    assert finish == "length", (text, finish)
    with capsys.disabled():
        print(f"\nreadiness: prefill {name} NotReady with 0 decodes (/ready: {body['reason']!r}), Ready again with "
              f"{pools}, not restarted")
    servers = [*node_serving.pod_servers(kube, ns, "prefill"), *node_serving.pod_servers(kube, ns, "decode")]
    readings = wait_all_released(servers, timeout=30)
    assert nothing_held(readings), readings


def _try_stream(chat):
    """One short stream through the Service, or None while the router's endpoints catch up."""
    import openai

    try:
        return node_serving.stream_chat(chat.base_url, chat.model, "and now?", max_tokens=4, ignore_eos=True,
                                        timeout=60)
    except openai.APIConnectionError:
        return None
