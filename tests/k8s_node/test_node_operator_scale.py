"""bench/tools/operator_scale.py (issue 50 item 5) on the node tier, at its smallest: one step of 3 sim pods
(a prefill and two decode pools of one pod, and a router), so the benchmark's phases keep working on
real pods: apply -> Ready, the status's latency after a decode server is killed (SIGKILL of its
container) and its recovery, a rollout of every pool while streams go through the router with none
lost, the namespace deleted. Its process accounting finds the pods' sim servers in the node's cgroups.
The figures are not checked against targets here (docs/benchmarks.md has the measured run).
"""

from __future__ import annotations

import subprocess

import pytest

from harness.bench_tools import load_bench_tool
from harness.operator_harness import get_json

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

PODS = 3
HANG_GUARD_S = 300


@pytest.mark.timeout(5 * HANG_GUARD_S)
def test_the_operator_scale_benchmark_runs_one_small_step(node_kube, chart, capsys):
    tool = load_bench_tool("operator_scale")
    args = tool.parse(["--pods", str(PODS), "--decode-pools", "2", "--clients", "2", "--long-clients", "1",
                       "--hang-guard-s", str(HANG_GUARD_S)])
    new_image = f"{node_kube.image}-scale"
    subprocess.run([*node_kube.ctr, "images", "tag", "--force", node_kube.image, new_image], check=True,
                   capture_output=True)
    step = tool.run_step(node_kube, PODS, args, new_image)
    with capsys.disabled():
        print("\n" + tool.line(step))
    assert "error" not in step, step["error"]
    apply, kill, rollout = step["apply"], step["kill"], step["rollout"]
    assert 0 < apply["isvc_ready_s"] <= apply["isvc_full_s"] and apply["pods_ready_s"] > 0, apply
    assert apply["pod_startup_s"]["ready"]["n"] == PODS + 1, apply             # the router too
    assert 0 < kill["pod_not_ready_s"] <= kill["status_latency_s"] < kill["recovered_s"], kill
    assert rollout["lost"] == 0, rollout["lost_examples"]
    assert rollout["short_during_rollout"] > 0 and rollout["long_streams_ok"] > 0, rollout
    procs = step["at_ready"]["processes"]
    assert procs["sim-prefill"]["count"] == 1 and procs["sim-decode"]["count"] == 2, procs
    assert procs["shim"]["count"] >= PODS + 1 and procs["kubelet"]["count"] == 1, procs
    assert step["delete"]["deleted_s"] > 0 and get_json(node_kube, "namespace", f"{tool.ISVC}-{PODS}") is None
