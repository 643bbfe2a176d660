"""NetworkPolicies enforced on the one-node cluster (tests/harness/kube_node.py): kube-router's network
policy controller, alone (``--run-firewall``; no routing, no service proxy, no CNI of its own: the bridge
plugin wires the pods and kube-proxy keeps the Services).

The bridge plugin enforces nothing; kube-router watches pods, namespaces and NetworkPolicies and writes
iptables chains (KUBE-ROUTER-*, KUBE-POD-FW-*, KUBE-NWPLCY-*) and ipsets (KUBE-SRC-*, KUBE-DST-*): traffic
to a pod a policy selects, that no rule admits, is rejected (a connection attempt fails at once). Pods
on one bridge reach each other bridged, so this needs ``net.bridge.bridge-nf-call-iptables`` (1 on this
machine; the kubelet sets it too). Traffic from the node itself (the kubelet's probes, the tests on this
machine) is always admitted: kube-router's rule for "the pod's local node".

    proc = start(group, bin_dir, kubeconfig, logs)   # waits for its /healthz and its first sync
    destroy_ipsets()                                  # after its chains are gone (kube_node_host)

The binary is built by tools/k8s/build.sh (tools/k8s/kube-router/go.mod pins the version; kube-router's
own ``--cleanup-config`` is not used: it also cleans IPVS and panics in 2.1.0 without a service proxy).
"""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

from harness.conditions import wait_until
from harness.kube_control_plane import _die_with_parent, _log_tail
from harness.kube_node_config import NODE_NAME
from pdserve.net import free_port

BINARY = "kube-router"
IPSET_PREFIXES = ("KUBE-", "kube-router")
READY_TIMEOUT_S = 60.0
FIRST_SYNC = "sync iptables took"  # its log line (at --v=1) after each full sync of the chains and ipsets


def start(group, bin_dir: Path, kubeconfig: Path, logs: Path) -> subprocess.Popen:
    """kube-router's policy controller, in ``group``; returns once it serves /healthz and has synced once."""
    health = free_port()
    proc = group.start([str(bin_dir / BINARY), f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}",
                        "--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--enable-cni=false",
                        f"--health-port={health}", "--metrics-port=0", "--iptables-sync-period=30s", "--v=1"],
                       name=BINARY, preexec_fn=_die_with_parent)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{BINARY} exited with {proc.returncode}; its log ends:\n"
                               f"{_log_tail(logs / f'{BINARY}.log', 40)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=2) as r:
                healthy = r.status == 200
        except OSError:
            return False
        log = logs / f"{BINARY}.log"
        return healthy and log.exists() and FIRST_SYNC in log.read_text(errors="replace")

    wait_until(ready, f"{BINARY}'s network policy controller to sync", READY_TIMEOUT_S, 0.5)
    return proc


def ipsets() -> list[str]:
    """The ipsets kube-router makes that exist now."""
    out = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True, check=True).stdout
    return sorted(name for name in out.split() if name.startswith(IPSET_PREFIXES))


def destroy_ipsets() -> list[str]:
    """Destroy kube-router's ipsets (once no iptables rule uses them); returns what could not be."""
    problems = []
    for name in ipsets():
        done = subprocess.run(["ipset", "destroy", name], capture_output=True, text=True)
        if done.returncode != 0:
            problems.append(f"ipset {name}: {done.stderr.strip()}")
    return problems
