"""Rollouts on real pods keep serving (the `chat` InferenceService, conftest.py).

The built image gets a second name in containerd (what a new release's image is to the kubelet).
`spec.image` is patched while clients stream through the router's Service: the operator changes
every pod template, the Deployments roll (surge 1, none unavailable, a new pod available 5 s after
Ready), old pods drain on their way out. No stream is lost, every pod ends on the new image and
the new pods serve. Then `spec.protocolVersion` (this release's + 1) is patched the same way.
Each test ends by removing its patch (back to the defaults, idle) so that the other tests find the
InferenceService as the user path left it.

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
ROLL_TIMEOUT_S = 600


def _shape(pods: list[dict]) -> dict[str, int]:
    """Pods per role/pool."""
    out: dict[str, int] = {}
    for p in pods:
        key = f"{p['metadata']['labels']['pdserve.io/role']}/{p['metadata']['labels']['pdserve.io/pool']}"
        out[key] = out.get(key, 0) + 1
    return out


def _rolled_to(kube, ns: str, image: str, version: str, shape: dict[str, int]):
    """The pods when every one runs `image` with `version`, is Ready, none is terminating, in `shape`; else None."""
    pods = kube.pods(ns, f"pdserve.io/inference-service={ISVC}")
    if any(p["metadata"].get("deletionTimestamp") for p in pods) or _shape(pods) != shape:
        return None
    for p in pods:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        if not ready or p["spec"]["containers"][0]["image"] != image or p["metadata"]["labels"][PROTOCOL_LABEL] != version:
            return None
    isvc = get_json(kube, "inferenceservice", ISVC, "-n", ns)
    if isvc.get("status", {}).get("observedGeneration") != isvc["metadata"]["generation"]:
        return None
    return pods if node_serving.isvc_ready(kube, ns, ISVC) else None


def _roll(kube, chat, capsys, patch: dict, image: str, version: str) -> list[str]:
    """Apply `patch` while clients stream; wait until every pod runs `image` with `version`; check that
    the new pods serve and nothing is held; return the lost streams. Always ends back on the defaults."""
    ns = chat.namespace
    old_image, old_version = kube.image, str(PROTOCOL_VERSION)
    shape = _shape([p for p in kube.pods(ns, f"pdserve.io/inference-service={ISVC}")
                    if not p["metadata"].get("deletionTimestamp")])
    kube.wait_until(lambda: _rolled_to(kube, ns, old_image, old_version, shape), 180, 2, "the InferenceService settled")
    before = {p["metadata"]["name"] for p in kube.pods(ns, f"pdserve.io/inference-service={ISVC}")}
    try:
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
            print(f"\nrollout {patch} under load: every pod replaced in {rolled_s:.0f}s; {short.ok} short and "
                  f"{long.ok} long streams completed, {len(lost)} lost"
                  + (f" between {when[0]}s and {when[-1]}s after the patch: {lost[:2]}" if lost else ""))
        assert long.ok + len(long.errors) == 2
        assert during >= 2 and (lost or short.ok >= during + 4), (during, short.ok)
        assert before.isdisjoint(p["metadata"]["name"] for p in pods)
        (prefill,) = node_serving.pod_servers(kube, ns, "prefill")
        assert metric(prefill.url, "pdserve_requests_total") > 0     # the new prefill found new decodes and served
        readings = wait_all_released([prefill, *node_serving.pod_servers(kube, ns, "decode")], timeout=30)
        assert nothing_held(readings), readings
        return lost
    finally:
        # back to the defaults (this release's image and protocol), idle: the other tests expect them
        kube.kubectl("patch", "inferenceservice", ISVC, "-n", ns, "--type=merge", "-p",
                     json.dumps({"spec": {"image": None, "protocolVersion": None}}))
        kube.wait_until(lambda: _rolled_to(kube, ns, old_image, old_version, shape), ROLL_TIMEOUT_S, 2,
                        f"every pod back on {old_image}, protocol {old_version}")


def _next_image(kube) -> str:
    """The built image under a second name (a new release's image, as far as the kubelet can tell)."""
    new_image = f"{kube.image}-next"
    subprocess.run([*kube.ctr, "images", "tag", "--force", kube.image, new_image], check=True, capture_output=True)
    return new_image


@pytest.mark.timeout(2 * ROLL_TIMEOUT_S + 300)  # there and back on a 2-core node
def test_image_rollout_keeps_serving(node_kube, chat, capsys):
    new_image = _next_image(node_kube)
    lost = _roll(node_kube, chat, capsys, {"image": new_image}, new_image, str(PROTOCOL_VERSION))
    assert lost == [], lost


@pytest.mark.timeout(2 * ROLL_TIMEOUT_S + 300)
def test_protocol_rollout_keeps_serving(node_kube, chat, capsys):
    new_image, new_version = _next_image(node_kube), str(PROTOCOL_VERSION + 1)
    lost = _roll(node_kube, chat, capsys, {"image": new_image, "protocolVersion": new_version}, new_image, new_version)
    assert lost == [], lost
