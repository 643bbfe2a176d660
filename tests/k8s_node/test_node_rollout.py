"""Rollouts on real pods keep serving (the `chat` InferenceService, conftest.py), chained: the first
rolls to a new image, the second to a new protocol version from where the first left off. Neither
rolls back (a roll-back is a third and fourth rollout of the same kind): conftest.py runs this file
last, after the tests that expect the example's defaults.

The built image gets more names in containerd (what a new release's image is to the kubelet).
`spec.image` is patched (to `<image>-next`) while clients stream through the router's Service: the
operator changes every pod template, the Deployments roll (surge 1, none unavailable, a new pod
available 5 s after Ready), old pods drain on their way out. No stream is lost, every pod is
replaced, every pod ends on the new image, the new pods serve and nothing is held afterwards. Then
a release with a new protocol: `spec.image` (`<image>-next2`) and `spec.protocolVersion` (one more
than the InferenceService's) are patched together, with the same checks. Each test starts from
what the InferenceService's spec asks for when it begins (the defaults when it runs alone), so
either can also run by itself.

A protocol rollout keeps serving because the operator keeps each decode pool's Service for the old
version (retired, operator/protocol_rollout.py) until the prefill Deployment has rolled, and the router
sends a request that an old prefill refuses for want of a decode (its decodes left first) to another
prefill, waiting a few seconds for one if none can take it (router/http_api.py).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from harness import node_serving
from harness.node_streams import Streams
from harness.operator_harness import get_json
from harness.pd_cluster import metric, nothing_held, wait_all_released
from pdserve.protos.version import PROTOCOL_VERSION

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ISVC = "chat"
PROTOCOL_LABEL = "pdserve.io/protocol-version"
ROLL_TIMEOUT_S = 600  # hang guards: a rollout takes 70-95 s on a 2-core node
SETTLE_TIMEOUT_S = 180


def _shape(pods: list[dict]) -> dict[str, int]:
    """Pods per role/pool."""
    out: dict[str, int] = {}
    for p in pods:
        key = f"{p['metadata']['labels']['pdserve.io/role']}/{p['metadata']['labels']['pdserve.io/pool']}"
        out[key] = out.get(key, 0) + 1
    return out


def _asked_for(kube, ns: str) -> tuple[str, str]:
    """(image, protocol version) the InferenceService's spec asks for now (this release's where unset)."""
    spec = get_json(kube, "inferenceservice", ISVC, "-n", ns)["spec"]
    return spec.get("image") or kube.image, str(spec.get("protocolVersion") or PROTOCOL_VERSION)


def _rolled_to(kube, ns: str, image: str, version: str, shape: dict[str, int]):
    """The pods when every one runs `image` with `version`, is Ready, none is terminating, in `shape`; else None."""
    pods = kube.pods(ns, f"pdserve.io/inference-service={ISVC}")
    if any(p["metadata"].get("deletionTimestamp") for p in pods) or _shape(pods) != shape:
        return None
    for p in pods:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        if (not ready or p["spec"]["containers"][0]["image"] != image
                or p["metadata"]["labels"][PROTOCOL_LABEL] != version):
            return None
    isvc = get_json(kube, "inferenceservice", ISVC, "-n", ns)
    if isvc.get("status", {}).get("observedGeneration") != isvc["metadata"]["generation"]:
        return None
    return pods if node_serving.isvc_ready(kube, ns, ISVC) else None


def _roll(kube, chat, capsys, patch: dict, image: str, version: str) -> list[str]:
    """From where the InferenceService is, apply `patch` while clients stream; wait until every pod runs
    `image` with `version`; check that every pod was replaced, the new pods serve and nothing is held;
    return the lost streams. The InferenceService stays on the new image and version."""
    ns = chat.namespace
    old_image, old_version = _asked_for(kube, ns)
    shape = _shape([p for p in kube.pods(ns, f"pdserve.io/inference-service={ISVC}")
                    if not p["metadata"].get("deletionTimestamp")])
    kube.wait_until(lambda: _rolled_to(kube, ns, old_image, old_version, shape), SETTLE_TIMEOUT_S, 2,
                    f"the InferenceService settled on {old_image}, protocol {old_version}")
    before = {p["metadata"]["name"] for p in kube.pods(ns, f"pdserve.io/inference-service={ISVC}")}
    t0 = time.monotonic()
    with Streams(chat, loop=2) as short, Streams(chat, once=2, long=600) as long:
        short.wait_done(2)
        kube.kubectl("patch", "inferenceservice", ISVC, "-n", ns, "--type=merge", "-p", json.dumps({"spec": patch}))
        try:
            pods = kube.wait_until(lambda: _rolled_to(kube, ns, image, version, shape), ROLL_TIMEOUT_S, 2,
                                   f"every pod on {image}, protocol {version}")
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{node_serving.describe(kube, ns)}") from None
        rolled_s = time.monotonic() - t0
        during = short.ok
        short.wait_done(4)                               # the new pods serve
    lost = short.errors + long.errors
    when = sorted(round(t - t0, 1) for t in short.error_times + long.error_times)
    with capsys.disabled():
        print(f"\nrollout {patch} from {old_image}, protocol {old_version}, under load: every pod replaced in "
              f"{rolled_s:.0f}s; {short.ok} short and {long.ok} long streams completed, {len(lost)} lost"
              + (f" between {when[0]}s and {when[-1]}s after the patch: {lost[:2]}" if lost else ""))
    assert long.ok + len(long.errors) == 2
    assert during >= 2 and (lost or short.ok >= during + 4), (during, short.ok)
    assert before.isdisjoint(p["metadata"]["name"] for p in pods)
    (prefill,) = node_serving.pod_servers(kube, ns, "prefill")
    assert metric(prefill.url, "pdserve_requests_total") > 0     # the new prefill found new decodes and served
    readings = wait_all_released([prefill, *node_serving.pod_servers(kube, ns, "decode")], timeout=30)
    assert nothing_held(readings), readings
    return lost


def _new_image(kube, suffix: str) -> str:
    """The built image under another name (a new release's image, as far as the kubelet can tell)."""
    new_image = f"{kube.image}-{suffix}"
    subprocess.run([*kube.ctr, "images", "tag", "--force", kube.image, new_image], check=True, capture_output=True)
    return new_image


@pytest.mark.timeout(SETTLE_TIMEOUT_S + ROLL_TIMEOUT_S + 300)
def test_image_rollout_keeps_serving(node_kube, chat, capsys):
    new_image = _new_image(node_kube, "next")
    _, version = _asked_for(node_kube, chat.namespace)
    lost = _roll(node_kube, chat, capsys, {"image": new_image}, new_image, version)
    assert lost == [], lost


@pytest.mark.timeout(SETTLE_TIMEOUT_S + ROLL_TIMEOUT_S + 300)
def test_protocol_rollout_keeps_serving(node_kube, chat, capsys):
    """Runs after the image rollout (file order): from <image>-next, protocol N to <image>-next2, N + 1."""
    new_image = _new_image(node_kube, "next2")
    _, version = _asked_for(node_kube, chat.namespace)
    new_version = str(int(version) + 1)
    lost = _roll(node_kube, chat, capsys, {"image": new_image, "protocolVersion": new_version}, new_image, new_version)
    assert lost == [], lost
