"""bench/tools/operator_scale.py's pure parts (the run itself needs the node tier: tests/k8s_node): the
InferenceService's shape for N pods, the pods a rollout's peak puts on the node, which process is what,
the pods' start-up spread, the refusals, the command line; and the node's pod capacity it asks the
kubelet for (harness/kube_node_config.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from harness.bench_tools import load_bench_tool
from harness.kube_node_config import MAX_PODS, kubelet_yaml


@pytest.fixture(scope="module")
def tool():
    return load_bench_tool("operator_scale")


def test_shape_puts_a_fifth_on_prefill_and_spreads_the_rest(tool):
    assert tool.shape(200, 4) == (40, [40, 40, 40, 40])
    assert tool.shape(22, 4) == (4, [5, 5, 4, 4])
    assert tool.shape(3, 4) == (1, [1, 1])             # no pool of 0 pods
    prefills, decodes = tool.shape(101, 3)
    assert prefills + sum(decodes) == 101 and max(decodes) - min(decodes) <= 1
    with pytest.raises(ValueError, match="at least a prefill and a decode"):
        tool.shape(1, 4)


def test_the_spec_has_every_pool_on_the_sim_engine_with_the_rollout(tool):
    rollout = {"maxSurge": "10%", "maxUnavailable": "10%"}
    doc = tool.service("img:1", 10, 2, rollout)
    spec = doc["spec"]
    pools = [spec["prefill"], *spec["decode"]]
    assert [p["replicas"] for p in pools] == [2, 4, 4] and spec["image"] == "img:1"
    assert all(p["engine"] == {"name": "sim", "simProfile": "cpu-small"} and p["rollout"] == rollout for p in pools)
    assert "resources" not in spec["prefill"]          # no requests: N pods fit 2 cores' allocatable


def test_a_rollouts_peak_counts_surge_and_terminating_pods(tool):
    # 200 = 40 prefills + 4 x 40 decodes: 4 surge and 4 terminating per pool, and the others
    assert tool.pods_needed(200, 4, "10%", "10%") == 200 + 5 * 8 + tool.OTHER_PODS
    assert tool.pods_needed(10, 1, "1", "0") == 10 + 2 + tool.OTHER_PODS      # a count: one pod per pool
    assert tool.rollout_pods("25%", 10, True) == 3 and tool.rollout_pods("25%", 10, False) == 2
    assert tool.rollout_pods("0", 10, True) == 0 and tool.rollout_pods("3", 10, False) == 3


def test_processes_are_told_apart_by_subcommand_cgroup_and_work_folder(tool):
    pod = "12:memory:/pdserve-node/kubepods/besteffort/podabc/123\n"
    from bench.tools.cluster_procs import _kind as kind  # operator_scale.py's process accounting
    assert kind("/opt/venv/bin/python /opt/venv/bin/pdserve decode --engine sim --prefill-x 1", pod, "/w") \
        == "sim-decode"
    assert kind("pdserve prefill --engine=sim", pod, "/w") == "sim-prefill"
    assert kind("pdserve router --port 1", pod, "/w") == "router"
    assert kind("pdserve operator", pod, "/w") == "operator"
    assert kind("/pause", pod, "/w") == "pause"
    host = "12:memory:/user.slice\n"
    assert kind("/usr/bin/containerd-shim-runc-v2 -address /w/pdserve-node/c.sock", host, "/w") == "shim"
    assert kind("/k8s/bin/kubelet --config=/w/pdserve-node/kubelet.yaml", host, "/w") == "kubelet"
    assert kind("/k8s/bin/kubelet --config=/other/kubelet.yaml", host, "/w") is None   # another cluster's
    assert kind("pdserve decode --engine sim", host, "/w") is None                   # a sim server off the node


def test_pod_startup_spread_from_the_pods_own_stamps(tool):
    def pod(created, scheduled, started, ready):
        return {"metadata": {"creationTimestamp": created},
                "status": {"conditions": [{"type": "PodScheduled", "lastTransitionTime": scheduled},
                                          {"type": "Ready", "lastTransitionTime": ready}],
                           "containerStatuses": [{"state": {"running": {"startedAt": started}}}]}}

    pods = [pod("2026-12-06T14:00:00Z", "2026-12-06T14:00:01Z", "2026-12-06T14:00:04Z", "2026-12-06T14:00:10Z"),
            pod("2026-12-06T14:00:00Z", "2026-12-06T14:00:02Z", "2026-12-06T14:00:08Z", "2026-12-06T14:00:20Z")]
    out = tool.pod_startup(pods)
    assert out["scheduled"] == {"n": 2, "p50": 1.5, "p90": 2.0, "max": 2.0}
    assert out["ready"]["max"] == 20.0 and out["started"]["p50"] == 6.0
    assert tool.spread([]) == {}


def test_a_step_beyond_the_pod_network_is_refused_naming_it(tool):
    args = SimpleNamespace(decode_pools=4, max_surge="25%", max_unavailable="25%", guess_mib_per_pod=1.0,
                           reserve_gib=0.0, budget_min=25.0)
    why = tool.refusal(250, args, [], 0.0)
    assert why and f"holds {MAX_PODS}" in why
    args.guess_mib_per_pod = 1e9                        # a petabyte a pod: no machine has it
    assert "MemAvailable" in tool.refusal(10, args, [], 0.0)


def test_bad_command_lines_are_refused(tool, capsys):
    assert tool.parse(["--pods", "20,50"]).steps == [20, 50]
    for bad in (["--pods", "20,x"], ["--pods", "1"], ["--max-surge", "10x"], ["--max-unavailable", "120%"],
                ["--decode-pools", "0"]):
        with pytest.raises(SystemExit) as e:
            tool.parse(bad)
        assert e.value.code == 2
    assert "--pods" in capsys.readouterr().err


def test_the_kubelet_gets_the_pod_capacity_asked_for(tmp_path):
    common = dict(root_dir=tmp_path, ca=tmp_path / "ca", serving=(tmp_path / "k", tmp_path / "c"),
                  runtime_socket=tmp_path / "s", cgroup_root="/x", port=1, healthz_port=2, logs_dir=tmp_path,
                  plugin_dir=tmp_path)
    assert "maxPods" not in yaml.safe_load(kubelet_yaml(**common))            # the kubelet's default (110)
    assert yaml.safe_load(kubelet_yaml(**common, max_pods=240))["maxPods"] == 240
