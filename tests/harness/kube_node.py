"""A one-node Kubernetes cluster on this machine, where pods really run: the control plane of
kube_control_plane.py plus kube-scheduler, kube-proxy (iptables), kubelet, containerd (CRI), runc
and the bridge CNI plugin, with NetworkPolicies enforced by kube-router's policy controller
(kube_node_policy.py). The pdserve image (tools/image/build.sh) is imported into containerd,
so pods use it with imagePullPolicy IfNotPresent or Never; no registry is involved.

    with node_cluster(work_dir) as cluster:            # a NodeCluster (a KubeCluster) once the node is Ready
        cluster.kubectl("apply", "-f", "examples/inferenceservice.yaml")
        cluster.image                                   # "localhost/pdserve:<hash>", already in containerd
        cluster.cluster_ip("ns", "svc")                 # reachable from this machine through kube-proxy

Start-up: lock the machine (one such cluster at a time), record the sysctls, sweep what a killed
run may have left, start the control plane with the API server on every address (pods reach it
as Service default/kubernetes), containerd, import the images, the kubelet, kube-proxy and the
scheduler; wait until the node is Ready and untainted and 10.96.0.1:443 answers from the host;
then kube-router, until it has synced the policies once.
Tear-down (also when start-up or the body fails): delete the tests' namespaces so the kubelet
stops their pods (CNI DEL), stop the node's processes, remove what is left (containers, mounts,
iptables chains, kube-router's ipsets, the bridge, cgroups, log links) and restore the sysctls; then compare the
machine with `machine_state()` as it was before the node started (processes, iptables chains,
mounts, the bridge, cgroups, sysctls). Anything that could not be put back, or differs, raises
NodeTeardownError naming it. kube_node_host.py knows that machine state,
kube_node_config.py the configuration files, kube_node_images.py the images.

Needs root, the binaries of `make k8s-tools` (kubelet, kube-proxy, kube-scheduler, pause, kube-router),
the Debian packages containerd, runc, containernetworking-plugins, iptables, ipset (tools/k8s/build.sh installs
them) and `make image`. Standalone (`make cluster`): `.venv/bin/python tests/harness/kube_node.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

if __name__ == "__main__":  # standalone: make `harness` importable as in the tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import kube_node_config as config
from harness import kube_node_host as host
from harness import kube_node_policy as policy
from harness.kube import KubeCluster
from harness.kube_control_plane import (KubeToolsMissing, _b64, _die_with_parent, _log_tail, _stop, control_plane,
                                        require_tools, tools_bin_dir, wait_until, write_kubeconfig)
from harness.kube_node_images import PAUSE_IMAGE, import_image, pdserve_image, write_pause_image
from harness.procs import ProcessGroup
from pdserve.net import free_port

NODE_BINARIES = ("kubelet", "kube-proxy", "kube-scheduler", "pause", policy.BINARY)
HOST_COMMANDS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "ip", "ipset")
MARKER = "pdserve-node"  # every directory of the node is under a folder of this name (the sweep finds them)
CGROUP_ROOT_NAME = "pdserve-node"
# Made by containerd's shims and the kubelet when missing; removed again if they were missing before.
MACHINE_DIRS = (Path("/run/containerd"), Path("/var/log/containers"))
SYSTEM_NAMESPACES = {"default", "kube-system", "kube-public", "kube-node-lease"}
READY_TIMEOUT_S = 300.0
# Processes the node killed (containerd's shims, pause) are gone once reaped: a moment, bounded by this hang guard.
EXIT_HANG_GUARD_S = 30.0


class NodeTeardownError(RuntimeError):
    """Something the node changed on this machine could not be put back; the message lists it."""


@dataclass
class NodeCluster(KubeCluster):
    """A KubeCluster whose pods run. image: the pdserve image in containerd; timings: seconds per start-up step."""

    node_ip: str = ""
    node_name: str = config.NODE_NAME
    image: str = ""
    ctr: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def cluster_ip(self, namespace: str, service: str) -> str:
        return self.kubectl("get", "service", service, "-n", namespace, "-o", "jsonpath={.spec.clusterIP}").stdout

    def pods(self, namespace: str, selector: str) -> list[dict]:
        return json.loads(self.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]

    def make_pods_ready(self, *args, **kwargs):
        raise TypeError("a NodeCluster runs its pods: wait for them instead of faking their readiness")


def _client_kubeconfig(path: Path, server: str, pki, name: str, cn: str, org: str | None = None) -> Path:
    key, crt = pki.cert(name, cn, org=org, ext="clientAuth")
    write_kubeconfig(path, {"server": server, "certificate-authority-data": _b64(pki.ca[1])}, cn,
                     {"client-certificate-data": _b64(crt), "client-key-data": _b64(key)}, "default")
    return path


def machine_state() -> dict:
    """What the node changes on this machine, comparable before and after: its processes (containerd,
    shims, kubelet, kube-proxy, kube-scheduler, pause), KUBE-*/CNI-* iptables chains, mounts under a
    node folder, the bridge, the kubelet's cgroup root and the sysctls it may set."""
    procs = subprocess.run(["pgrep", "-af", "containerd|kubelet|kube-proxy|kube-scheduler|kube-router|pause"],
                           capture_output=True, text=True).stdout
    return {
        "processes": sorted(line for line in procs.splitlines()
                            if MARKER in line or Path((line.split() + ["", ""])[1]).name == "pause"),
        "iptables": host.iptables_leftovers(),
        "ipsets": policy.ipsets(),
        "bridge": host.link_exists(config.BRIDGE),
        "mounts": [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if f"/{MARKER}" in line.split()[4]],
        "cgroups": [str(d) for d in host.cgroup_dirs(CGROUP_ROOT_NAME)],
        "sysctls": {k: host.Sysctls.read(k) for k in host.SYSCTLS},
    }


def _not_put_back(before: dict) -> list[str]:
    """How the machine differs from `before` (a machine_state()), once the killed processes are gone:
    a process that was not there before is left; one that was may have ended since."""
    deadline = time.monotonic() + EXIT_HANG_GUARD_S
    while True:
        after = machine_state()
        new = sorted(set(after["processes"]) - set(before["processes"]))
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    problems = [f"processes left: {new}"] if new else []
    changed = {k: v for k, v in before["sysctls"].items() if after["sysctls"].get(k) != v}
    if changed:
        problems.append("sysctls changed (before -> after): "
                        + ", ".join(f"{k} {v} -> {after['sysctls'].get(k)}" for k, v in changed.items()))
    return problems + [f"{key}: before {before[key]}, after {after[key]}" for key in before
                       if key not in ("processes", "sysctls") and after[key] != before[key]]


def _check_prerequisites(bin_dir: Path) -> None:
    require_tools(bin_dir, NODE_BINARIES)
    missing = [c for c in HOST_COMMANDS if shutil.which(c) is None]
    if missing or not Path(config.CNI_BIN_DIR, "bridge").exists():
        raise KubeToolsMissing(f"missing {', '.join(missing) or 'the CNI plugins'}: run make k8s-tools "
                               "(it installs containerd, runc, containernetworking-plugins, iptables and ipset)")
    if subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip() != "0":
        raise PermissionError("the one-node cluster needs root (containerd, kubelet, iptables)")


def _sweep(work_roots: list[Path], proxy: Path | None) -> list[str]:
    """Remove what the node (this run's, or a killed run's) may have left; returns what could not be."""
    problems = []
    # Shims of this node's containerd outlive it by design; their containers too (in the cgroup root).
    out = subprocess.run(["pgrep", "-af", "containerd-shim"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, _, cmd = line.partition(" ")
        if MARKER in cmd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    problems += host.remove_cgroups(CGROUP_ROOT_NAME)
    if proxy is not None:
        subprocess.run([str(proxy), "--cleanup", "--v=0"], capture_output=True, timeout=60)
    problems += host.remove_iptables_chains()
    problems += policy.destroy_ipsets()  # kube-router's: only once no rule uses them
    problems += host.unmount_under(*work_roots)
    problems += host.delete_link(config.BRIDGE)
    return problems


def _stale_roots() -> list[Path]:
    """The node folders of earlier runs that still have mounts (a killed run)."""
    roots = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if f"/{MARKER}/" in point:
            roots.add(Path(point[: point.index(f"/{MARKER}/") + len(MARKER) + 1]))
    return sorted(roots)


@contextlib.contextmanager
def node_cluster(work_dir: Path, bin_dir: Path | None = None, with_image: bool = True,
                 max_pods: int | None = None) -> Iterator[NodeCluster]:
    """The one-node cluster (see the module docstring); with_image=False leaves the pdserve image out
    (only the pause image is in containerd); max_pods: the node's pod capacity (default the kubelet's, 110;
    at most config.MAX_PODS, the addresses of the pods' /24)."""
    if max_pods is not None and not 1 <= max_pods <= config.MAX_PODS:
        raise ValueError(f"max_pods {max_pods}: the node's pod network ({config.POD_CIDR}) holds 1 to "
                         f"{config.MAX_PODS} pods")
    bin_dir = bin_dir or tools_bin_dir()
    _check_prerequisites(bin_dir)
    image, archive = pdserve_image() if with_image else ("", None)
    node = work_dir / MARKER
    with host.machine_lock():
        sysctls = host.Sysctls()
        fresh_dirs = [d for d in MACHINE_DIRS if not d.exists()]
        problems = _sweep(_stale_roots(), bin_dir / "kube-proxy")
        if problems:
            raise NodeTeardownError("an earlier one-node cluster left state "
                                    "that cannot be removed:\n" + "\n".join(problems))
        before = machine_state()
        before["sysctls"] = {k: sysctls.saved.get(k) for k in host.SYSCTLS}  # what restore() writes back
        problems = []
        try:
            with _running(work_dir, node, bin_dir, image, archive, max_pods) as cluster:
                yield cluster
        finally:
            problems += _sweep([node], bin_dir / "kube-proxy")
            # The image store (the unpacked image: gigabytes) goes; configurations and logs stay.
            if not host.mounts_under(node):
                for d in ("containerd", "kubelet", "cni"):
                    shutil.rmtree(node / d, ignore_errors=True)
            host.remove_container_log_links(node)
            problems += host.remove_empty_trees(fresh_dirs)
            problems += host.remove_cgroups(CGROUP_ROOT_NAME)
            problems += sysctls.restore()
            left = host.iptables_leftovers()
            if left:
                problems.append("iptables chains left: " + ", ".join(left))
            problems += _not_put_back(before)
    if problems:
        raise NodeTeardownError("the one-node cluster could not put back:\n" + "\n".join(problems))


@contextlib.contextmanager
def _running(work_dir: Path, node: Path, bin_dir: Path, image: str, archive: Path | None,
             max_pods: int | None = None) -> Iterator[NodeCluster]:
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    node_ip = host.host_ip()
    logs = work_dir / "logs"
    with control_plane(work_dir / "control-plane", bin_dir, node_ip=node_ip) as cp:
        timings["control_plane_s"] = time.monotonic() - t0
        group = ProcessGroup(log_dir=logs)
        cluster = NodeCluster(kubeconfig=cp.kubeconfig, server=cp.server, bin_dir=cp.bin_dir, work_dir=work_dir,
                              node_ip=node_ip, image=image, timings=timings)
        try:
            _start_node(cluster, cp, node, bin_dir, group, archive, max_pods)
            timings["total_s"] = time.monotonic() - t0
            yield cluster
        finally:
            _drain(cluster)
            for proc in reversed(group.procs):
                _stop(proc)
            group.close()


def _start_node(cluster: NodeCluster, cp, node: Path, bin_dir: Path, group: ProcessGroup, archive: Path | None,
                max_pods: int | None = None) -> None:
    timings, logs = cluster.timings, cluster.work_dir / "logs"
    for d in ("containerd/root", "containerd/state", "cni/net.d", "cni/ipam", "kubelet", "pod-logs", "volume-plugins"):
        (node / d).mkdir(parents=True, exist_ok=True)
    # containerd (CRI) with the bridge CNI network
    (node / "cni/net.d/10-pdserve.conflist").write_text(config.cni_conflist(node / "cni/ipam"))
    sock = node / "containerd/containerd.sock"
    (node / "containerd.toml").write_text(config.containerd_toml(
        node / "containerd/root", node / "containerd/state", sock, node / "cni/net.d", PAUSE_IMAGE))
    t = time.monotonic()
    containerd = group.start(["containerd", f"--config={node / 'containerd.toml'}", "--log-level=info"],
                             name="containerd", preexec_fn=_die_with_parent)
    wait_until(lambda: _alive(containerd, logs, "containerd") and sock.exists(), 60, 0.2, "containerd's socket")
    cluster.ctr = ["ctr", "--address", str(sock), "-n", "k8s.io"]
    import_image(cluster.ctr, write_pause_image(bin_dir / "pause", node / "pause.oci.tar"), PAUSE_IMAGE)
    if archive is not None:
        timings["image_import_s"] = import_image(cluster.ctr, archive, cluster.image)
    timings["containerd_s"] = time.monotonic() - t

    # kubelet, kube-proxy, kube-scheduler
    pki = cp.pki
    kubelet_kc = _client_kubeconfig(node / "kubelet.kubeconfig", cp.server, pki, "kubelet-client",
                                    f"system:node:{config.NODE_NAME}", org="system:nodes")
    serving = pki.cert("kubelet-serving", config.NODE_NAME, ext="serverAuth",
                       san=[f"IP:{cluster.node_ip}", "IP:127.0.0.1", f"DNS:{config.NODE_NAME}"])
    host.make_cgroup_root(CGROUP_ROOT_NAME)
    kubelet_port, healthz_port = free_port(), free_port()
    (node / "kubelet.yaml").write_text(config.kubelet_yaml(
        root_dir=node / "kubelet", ca=pki.ca[1], serving=serving, runtime_socket=sock,
        cgroup_root=f"/{CGROUP_ROOT_NAME}", port=kubelet_port, healthz_port=healthz_port,
        logs_dir=node / "pod-logs", plugin_dir=node / "volume-plugins", max_pods=max_pods))
    t = time.monotonic()
    kubelet = group.start([str(bin_dir / "kubelet"), f"--config={node / 'kubelet.yaml'}", f"--kubeconfig={kubelet_kc}",
                           f"--root-dir={node / 'kubelet'}", f"--hostname-override={config.NODE_NAME}",
                           f"--node-ip={cluster.node_ip}", "--v=1"], name="kubelet", preexec_fn=_die_with_parent)
    proxy_kc = _client_kubeconfig(node / "kube-proxy.kubeconfig", cp.server, pki, "kube-proxy", "system:kube-proxy")
    (node / "kube-proxy.yaml").write_text(config.kube_proxy_yaml(kubeconfig=proxy_kc, healthz_port=free_port(),
                                                                  metrics_port=free_port()))
    proxy = group.start([str(bin_dir / "kube-proxy"), f"--config={node / 'kube-proxy.yaml'}", "--v=1"],
                        name="kube-proxy", preexec_fn=_die_with_parent)
    sched_kc = _client_kubeconfig(node / "scheduler.kubeconfig", cp.server, pki, "kube-scheduler",
                                  "system:kube-scheduler")
    (node / "scheduler.yaml").write_text(config.kube_scheduler_yaml(kubeconfig=sched_kc))
    scheduler = group.start([str(bin_dir / "kube-scheduler"), f"--config={node / 'scheduler.yaml'}",
                             "--secure-port=0", "--v=1"], name="kube-scheduler", preexec_fn=_die_with_parent)
    procs = {"containerd": containerd, "kubelet": kubelet, "kube-proxy": proxy, "kube-scheduler": scheduler}

    def node_ready() -> bool:
        for name, proc in procs.items():
            _alive(proc, logs, name)
        out = cluster.kubectl("get", "node", config.NODE_NAME, "-o", "json", check=False)
        if out.returncode != 0:
            return False
        n = json.loads(out.stdout)
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
        return ready and not any(t["key"].startswith("node.kubernetes.io/") for t in n["spec"].get("taints", []))

    try:
        wait_until(node_ready, READY_TIMEOUT_S, 0.5, f"node {config.NODE_NAME} to be Ready and untainted")
        # host -> ClusterIP of default/kubernetes -> the API server: kube-proxy's rules are in place
        wait_until(lambda: _connects("10.96.0.1", 443), 120, 0.5, "10.96.0.1:443 (Service kubernetes via kube-proxy)")
    except TimeoutError as e:
        tails = "\n".join(f"--- {n} ---\n{_log_tail(logs / f'{n}.log')}" for n in procs)
        raise TimeoutError(f"{e}\n{tails}") from None
    timings["node_s"] = time.monotonic() - t
    # NetworkPolicies enforced (kube_node_policy.py): kube-router's policy controller, once the node exists
    t = time.monotonic()
    router_kc = _client_kubeconfig(node / "kube-router.kubeconfig", cp.server, pki, "kube-router", "system:kube-router",
                                   org="system:masters")
    policy.start(group, bin_dir, router_kc, logs)
    timings["network_policy_s"] = time.monotonic() - t


def _alive(proc: subprocess.Popen, logs: Path, name: str) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"{name} exited with {proc.returncode}; its log "
                           f"ends:\n{_log_tail(logs / f'{name}.log', 40)}")
    return True


def _connects(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=2):
            return True
    except OSError:
        return False


def _save_pod_logs(cluster: NodeCluster) -> None:
    """Every pod's log (and its previous container's, after a restart) and the events, into logs/pods/."""
    out = cluster.work_dir / "logs" / "pods"
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(Exception):
        (out / "pods.txt").write_text(cluster.kubectl("get", "pods", "-A", "-o", "wide", timeout=30,
                                                      check=False).stdout)
        (out / "events.txt").write_text(cluster.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp",
                                                        timeout=30, check=False).stdout)
        pods = json.loads(cluster.kubectl("get", "pods", "-A", "-o", "json", timeout=30).stdout)["items"]
        for pod in pods:
            ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
            for previous in (False, True):
                proc = cluster.kubectl("logs", name, "-n", ns, "--all-containers",
                                       *(["--previous"] if previous else []), timeout=30, check=False)
                if proc.stdout:
                    (out / f"{ns}_{name}{'.previous' if previous else ''}.log").write_text(proc.stdout)


def _drain(cluster: NodeCluster, timeout: float = 90.0) -> None:
    """Delete the tests' namespaces and every pod, and wait (bounded) for the kubelet to stop them:
    it then tears their sandboxes down through CNI, which removes their iptables rules and veths.
    The pods' logs are saved first (work_dir/logs/pods)."""
    _save_pod_logs(cluster)
    with contextlib.suppress(Exception):
        names = cluster.kubectl("get", "namespaces", "-o", "jsonpath={.items[*].metadata.name}",
                                timeout=30).stdout.split()
        extra = [n for n in names if n not in SYSTEM_NAMESPACES]
        if extra:
            cluster.kubectl("delete", "namespace", *extra, "--wait=false", timeout=30, check=False)
        cluster.kubectl("delete", "pods", "--all", "-A", "--grace-period=5", "--wait=false", timeout=30, check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = cluster.kubectl("get", "pods", "-A", "-o", "name", timeout=30, check=False).stdout.strip()
            if not out:
                break
            time.sleep(1)
    # Whatever the kubelet did not stop: kill and remove the containers directly.
    if cluster.ctr:
        with contextlib.suppress(Exception):
            ids = subprocess.run([*cluster.ctr, "tasks", "ls", "-q"], capture_output=True, text=True,
                                 timeout=30).stdout.split()
            for cid in ids:
                subprocess.run([*cluster.ctr, "tasks", "kill", "-s", "SIGKILL", cid], capture_output=True, timeout=30)
            for cid in subprocess.run([*cluster.ctr, "containers", "ls", "-q"], capture_output=True, text=True,
                                      timeout=30).stdout.split():
                subprocess.run([*cluster.ctr, "tasks", "delete", "-f", cid], capture_output=True, timeout=30)
                subprocess.run([*cluster.ctr, "containers", "rm", cid], capture_output=True, timeout=30)


def _main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: sys.exit(0))
    work = Path(tempfile.mkdtemp(prefix="pdserve-cluster-"))
    start = time.monotonic()
    with node_cluster(work) as cluster:
        print(f"one-node cluster up in {time.monotonic() - start:.0f}s "
              f"({json.dumps({k: round(v) for k, v in cluster.timings.items()})})")
        print(f"node {cluster.node_name} at {cluster.node_ip}; image {cluster.image} is in containerd "
              f"(use imagePullPolicy: IfNotPresent or Never); logs in {work / 'logs'}")
        print(f"export KUBECONFIG={cluster.kubeconfig} PATH={cluster.bin_dir}:$PATH")
        print(f"helm install pdserve charts/pdserve -n pdserve-system --create-namespace "
              f"--set image.repository={cluster.image.rsplit(':', 1)[0]} --set "
              f"image.tag={cluster.image.rsplit(':', 1)[1]}")
        print("Ctrl-C or SIGTERM stops it and puts the machine back", flush=True)
        while True:
            signal.pause()


if __name__ == "__main__":
    _main()
