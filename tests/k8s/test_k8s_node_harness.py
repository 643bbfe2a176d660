"""The one-node cluster harness (tests/harness/kube_node.py) itself: a pod really runs (sandbox from
the locally built pause image, bridge CNI address, Service routed by kube-proxy), and afterwards the
machine is as before: no process, iptables chain, mount, bridge, cgroup or changed sysctl is left.

It runs without the pdserve image (the pause image is enough to run a pod); tests/k8s_node/ runs
the image. It lives here, not in tests/k8s_node/, because only one such cluster can run at a time.
"""

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from harness import kube_node_host as host
from harness.kube_node import CGROUP_ROOT_NAME, MARKER, node_cluster
from harness.kube_node_config import BRIDGE, NODE_NAME

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def machine_state() -> dict:
    procs = subprocess.run(["pgrep", "-af", "containerd|kubelet|kube-proxy|kube-scheduler|/pause"],
                           capture_output=True, text=True).stdout
    return {
        "iptables": host.iptables_leftovers(),
        "bridge": host.link_exists(BRIDGE),
        "mounts": [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if MARKER in line],
        "cgroups": [str(d) for d in host.cgroup_dirs(CGROUP_ROOT_NAME)],
        "sysctls": {k: host.Sysctls.read(k) for k in host.SYSCTLS},
        "processes": [line for line in procs.splitlines() if MARKER in line or "pause" in line.split()[1:2]],
    }


def test_pod_runs_and_the_machine_is_put_back():
    before = machine_state()
    with node_cluster(Path(tempfile.mkdtemp(prefix="pdserve-node-test-")), with_image=False) as cluster:
        assert cluster.node_ip and cluster.node_ip != "127.0.0.1"
        cluster.kubectl("run", "sleeper", "--image=pdserve.local/pause:1", "--image-pull-policy=Never", "--port=80")
        cluster.kubectl("expose", "pod", "sleeper", "--port=80")
        cluster.kubectl("wait", "--for=condition=Ready", "pod/sleeper", "--timeout=120s")
        pod = json.loads(cluster.kubectl("get", "pod", "sleeper", "-o", "json").stdout)
        assert pod["spec"]["nodeName"] == NODE_NAME and pod["status"]["podIP"].startswith("10.244.0.")
        during = machine_state()
        assert during["bridge"] and during["cgroups"] and during["mounts"]
        # kube-proxy programmed the Service (its chain is named after a hash of the service port)
        assert any("KUBE-SVC-" in c for c in during["iptables"]), during["iptables"]
        assert during["sysctls"]["net/ipv4/ip_forward"] == "1"
    after = machine_state()
    assert after == before
