"""Day-2 operations on real pods (the InferenceService of the `chat` fixture, conftest.py):

- `kubectl scale` of a decode pool up while clients stream: no stream is lost and the new pod
  joins (through the EndpointSlices the prefill watches) and takes sessions;
- `kubectl scale` down while the pods it removes hold long streams (a pod-deletion-cost makes the
  ReplicaSet remove exactly those): they drain (SIGTERM: refuse new sessions, finish live ones),
  so no stream is lost;
- the decode serving a stream dies after its first tokens (its container's process is SIGKILLed
  through containerd, as an OOM kill or a lost node would end it), then `kubectl delete pod --force
  --grace-period=0`: the stream resumes on another decode (prompt + tokens so far are prefilled
  again) or ends with a clear error, and the Deployment replaces the pod. (A delete alone sends
  SIGTERM first: the decode drains, and on a fast CPU it finishes the stream within the kubelet's
  2 s, so nothing is resumed and the test would test nothing.)
Each test leaves the example's replica counts and checks that no KV block, session or CacheStore
entry is still held anywhere.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter

import pytest

from harness import node_serving
from harness.node_streams import LONG, Streams
from harness.pd_cluster import get_json as http_json
from harness.pd_cluster import metric, nothing_held, wait_all_released

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

POOL = "main"
POOL_OBJECT = f"decodepool/chat-decode-{POOL}"


def _settled(kube, ns: str, pool: str, count: int):
    """The pool's ready pods when exactly `count` exist, all ready and none terminating; else None."""
    pods = kube.pods(ns, f"pdserve.io/role=decode,pdserve.io/pool={pool}")
    ready = node_serving.pod_servers(kube, ns, "decode", pool)
    return ready if len(pods) == count and len(ready) == count else None


def _scale(kube, ns: str, replicas: int) -> list:
    kube.kubectl("scale", POOL_OBJECT, "-n", ns, f"--replicas={replicas}")
    return kube.wait_until(lambda: _settled(kube, ns, POOL, replicas), 300, 1, f"{replicas} ready {POOL} decode pods")


def _routable(kube, ns: str) -> set[str]:
    (prefill,) = node_serving.pod_servers(kube, ns, "prefill")
    return {a.rsplit(":", 1)[0] for a in http_json(prefill.url + "/health")[1]["routable_decodes"]}


def _sessions(pod) -> int:
    return http_json(pod.url + "/health")[1]["sessions"]


def _all_released(kube, ns: str) -> dict:
    servers = [*node_serving.pod_servers(kube, ns, "prefill"), *node_serving.pod_servers(kube, ns, "decode")]
    return wait_all_released(servers, timeout=30)


def test_scale_up_under_load_loses_no_stream_and_the_new_pod_serves(node_kube, chat, capsys):
    ns = chat.namespace
    before = _settled(node_kube, ns, POOL, 2)
    assert before, node_serving.describe(node_kube, ns)
    t0 = time.monotonic()
    with Streams(chat, loop=2) as load:
        load.wait_done(2)
        up = _scale(node_kube, ns, 3)
        (new,) = [p for p in up if p.name not in {b.name for b in before}]
        node_kube.wait_until(lambda: new.ip in _routable(node_kube, ns), 60, 0.5,
                             "the prefill to route to the new decode")
        joined = time.monotonic() - t0
        node_kube.wait_until(lambda: metric(new.url, "pdserve_requests_total") > 0, 120, 0.5,
                             "the new decode to serve a request")
        load.wait_done(4)
    with capsys.disabled():
        print(f"\nscale {POOL} 2 -> 3 under load: {load.ok} streams completed, {len(load.errors)} lost; "
              f"the new pod was routable {joined:.0f}s after `kubectl scale`")
    assert load.errors == [], load.errors
    assert load.ok >= 6, load.ok
    _scale(node_kube, ns, 2)  # idle: nothing in flight on the removed pod
    readings = _all_released(node_kube, ns)
    assert nothing_held(readings), readings


def test_scale_down_drains_the_streams_of_removed_pods(node_kube, chat, capsys):
    ns = chat.namespace
    pods = _scale(node_kube, ns, 3)
    with Streams(chat, once=6, long=600) as streams:
        busy = node_kube.wait_until(lambda: [p for p in pods if _sessions(p) > 0][:2] if sum(
            _sessions(p) > 0 for p in pods) >= 2 else None, 60, 0.1, f"two {POOL} pods to hold a stream")
        # the ReplicaSet removes the pods with the lowest deletion cost first: exactly the busy ones
        for p in busy:
            node_kube.kubectl("annotate", "pod", p.name, "-n", ns, "controller.kubernetes.io/pod-deletion-cost=-1000")
        node_kube.kubectl("scale", POOL_OBJECT, "-n", ns, "--replicas=1")
    (left,) = node_kube.wait_until(lambda: _settled(node_kube, ns, POOL, 1), 300, 1, f"1 {POOL} pod left")
    assert left.name not in {p.name for p in busy}
    with capsys.disabled():
        print(f"\nscale {POOL} 3 -> 1 while the 2 removed pods hold 600-token streams: {streams.ok} of 6 finished, "
              f"{len(streams.errors)} lost {streams.errors[:1]}")
    assert streams.ok + len(streams.errors) == 6
    _scale(node_kube, ns, 2)
    readings = _all_released(node_kube, ns)
    assert nothing_held(readings), readings
    assert streams.errors == [], streams.errors


def _container(kube, ns: str, pod: str) -> str:
    """The containerd id of the pod's (one) container."""
    status = json.loads(kube.kubectl("get", "pod", pod, "-n", ns, "-o", "json").stdout)["status"]
    (container,) = status["containerStatuses"]
    return container["containerID"].split("://", 1)[1]


def _task_pid(kube, cid: str) -> int | None:
    """The container's process (`ctr tasks ls`: TASK PID STATUS); None once stopped or gone."""
    listed = subprocess.run([*kube.ctr, "tasks", "ls"], capture_output=True, text=True, check=True, timeout=30)
    row = next((line.split() for line in listed.stdout.splitlines() if line.startswith(cid)), None)
    return int(row[1]) if row and row[2] == "RUNNING" else None


def _kill_container(kube, pod: str, cid: str, pid: int) -> None:
    """SIGKILL the container's process through containerd (one `ctr` call: the ids were looked up before the
    stream, so the decode has no time to finish it first); returns when the process is gone."""
    subprocess.run([*kube.ctr, "tasks", "kill", "-s", "SIGKILL", cid], check=True, capture_output=True, timeout=30)
    kube.wait_until(lambda: _task_pid(kube, cid) != pid, 30, 0.1, f"{pod}'s container (pid {pid}) to die")


def test_decode_pod_killed_mid_stream_resumes_or_fails_clearly(node_kube, chat, capsys):
    import openai

    ns = chat.namespace
    decodes = node_serving.pod_servers(node_kube, ns, "decode")
    (prefill,) = node_serving.pod_servers(node_kube, ns, "prefill")
    # before the stream: each decode's container and process (the kill is then one call), and no session left
    # open anywhere by an earlier test, so the decode holding a session below is this stream's
    tasks = {d.name: (cid := _container(node_kube, ns, d.name), _task_pid(node_kube, cid)) for d in decodes}
    assert all(pid is not None for _, pid in tasks.values()), tasks
    node_kube.wait_until(lambda: all(_sessions(d) == 0 for d in decodes), 60, 0.2, "no decode to hold a session")
    retries_before = metric(prefill.url, "pdserve_decode_retries_total")
    per_pool = Counter(p["metadata"]["labels"]["pdserve.io/pool"] for p in node_kube.pods(ns, "pdserve.io/role=decode"))
    client = openai.OpenAI(base_url=chat.base_url, api_key="unused", timeout=300, max_retries=0)
    received, at_delete, finish, error, victim = 0, None, None, None, None
    try:
        for chunk in client.chat.completions.create(
                model=chat.model, messages=[{"role": "user", "content": "a long answer, please"}],
                max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}):
            for choice in chunk.choices:
                received += bool(choice.delta and choice.delta.content)
                finish = choice.finish_reason or finish
            if victim is None and received >= 20:
                # the decode holding this stream's session
                victim = next((d for d in decodes if _sessions(d) > 0), None)
                assert victim is not None, "no decode pod holds the stream's session"
                at_delete = received
                _kill_container(node_kube, victim.name, *tasks[victim.name])
                node_kube.kubectl("delete", "pod", victim.name, "-n", ns, "--grace-period=0", "--force")
    except openai.APIError as e:
        error = f"{type(e).__name__}: {e}"
    with capsys.disabled():
        print(f"\ndecode {victim.name} killed after {at_delete} streamed chunks: " +
              (f"stream failed: {error}" if error else f"resumed, {received} chunks, finish_reason {finish}"))
    pool = victim.name.split("-decode-", 1)[1].rsplit("-", 2)[0]  # <isvc>-decode-<pool>-<rs hash>-<id>
    replaced = node_kube.wait_until(lambda: _settled(node_kube, ns, pool, per_pool[pool]), 300, 1,
                                    f"the {pool} pool to be back at {per_pool[pool]} ready pods")
    assert victim.name not in {p.name for p in replaced}
    readings = _all_released(node_kube, ns)
    assert nothing_held(readings), readings
    if error:  # ending with an error is allowed, if it says what happened
        assert "decode" in error.lower(), error
    else:
        assert finish == "length" and received > at_delete, (finish, received, at_delete)
        assert metric(prefill.url, "pdserve_decode_retries_total") > retries_before
