"""Shared by the operator's real-cluster tests and bench/tools/operator_converge.py.

`install_chart` helm-installs charts/pdserve (CRDs, RBAC, ServiceAccount, the operator
Deployment, whose pod stays Pending: there is no kubelet) and waits for the CRDs to be
established. `OperatorProcess` runs `pdserve operator` as a local process with a kubeconfig
holding the chart's ServiceAccount token, so every call it makes goes through RBAC exactly
as the in-cluster pod's would.

Pods never run here, so "ready" is simulated where a test needs it: `mark_pods_ready` uses the
harness's fake kubelet (tests/harness/kube_kubelet.py: binds pods to a Node object, gives them IPs,
reports them Ready through pods/status); the ReplicaSet, Deployment and EndpointSlice
controllers then treat the pods as ready as usual.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from harness.procs import REPO, VENV_BIN

CHART = REPO / "charts" / "pdserve"
RELEASE = "pdop"
RELEASE_NAMESPACE = "pdserve-operator-test"
OPERATOR_SA = f"{RELEASE}-pdserve-operator"
IMAGE = "registry.test/pdserve:1"
CRD_NAMES = ["inferenceservices.pdserve.io", "prefillpools.pdserve.io", "decodepools.pdserve.io"]


def wait_crds_established(kube, names, timeout: float = 60.0) -> None:
    """Wait until each CRD's Established condition is True. (Not `kubectl wait --for=condition=...`:
    on a CRD created a moment before, with no status.conditions yet, it fails at once with
    "conditions accessor error" instead of waiting: 1 CI failure.)"""
    for name in names:
        kube.wait_until(lambda: ((c := condition(get_json(kube, f"crd/{name}"), "Established"))
                                 and c["status"] == "True"),
                        timeout=timeout, what=f"CRD {name} established")


def install_chart(kube) -> None:
    """helm install (or upgrade) the chart and wait until its CRDs are established."""
    kube.helm("upgrade", "--install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace")
    wait_crds_established(kube, CRD_NAMES)
    # Established comes a moment before the new resources' storage serves lists (429 until then).
    for crd in CRD_NAMES:
        kube.wait_until(lambda: kube.kubectl("get", crd.split(".")[0], "-A", check=False).returncode == 0,
                        timeout=60, what=f"{crd} to serve lists")


def get_json(kube, *args: str) -> dict | None:
    """kubectl get ... -o json; None when it does not exist."""
    proc = kube.kubectl("get", *args, "-o", "json", check=False)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr or "not found" in proc.stderr:
            return None
        raise RuntimeError(proc.stderr)
    return json.loads(proc.stdout)


def condition(obj: dict | None, type_: str) -> dict | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


def pod_ips(kube, namespace: str, selector: str) -> list[str]:
    pods = json.loads(kube.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]
    return [p["status"]["podIP"] for p in pods if p.get("status", {}).get("podIP")]


def mark_pods_ready(kube, namespace: str, selector: str, ready: bool = True) -> list[str]:
    """Make the pods matching selector Ready (kube.make_pods_ready: the harness's fake kubelet binds
    them to a Node object, gives them IPs and reports them Ready), or, with ready=False, report
    the already running ones not ready (as a failing readiness probe would). Returns their IPs."""
    if ready:
        count = len(json.loads(kube.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o",
                                            "json").stdout)["items"])
        kube.make_pods_ready(namespace, selector, count=max(count, 1))
        return pod_ips(kube, namespace, selector)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for ip_pod in json.loads(kube.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o",
                                          "json").stdout)["items"]:
        status = {"status": {"conditions": [{"type": t, "status": "False", "lastTransitionTime": now}
                                            for t in ("ContainersReady", "Ready")]}}
        kube.kubectl("patch", "pod", ip_pod["metadata"]["name"], "-n", namespace, "--subresource=status",
                     "--type=strategic", "-p", json.dumps(status))
    return pod_ips(kube, namespace, selector)


class OperatorProcess:
    """`pdserve operator` as a local process under the chart's ServiceAccount; start/kill/stop."""

    def __init__(self, kube, log_dir: Path, extra_args: tuple[str, ...] = (),
                 scope: tuple[str, ...] = ("--all-namespaces",),
                 service_account: tuple[str, str] = (RELEASE_NAMESPACE, OPERATOR_SA)):
        self.kube = kube
        self.log_dir = log_dir
        self.kubeconfig = kube.token_kubeconfig(*service_account)
        self.extra_args = (*scope, *extra_args)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = open(self.log_dir / f"operator-{self.starts}.log", "wb")
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "pdserve"), "operator", "--kubeconfig", str(self.kubeconfig),
             "--default-image", IMAGE, *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self.proc

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        path = self.log_dir / f"operator-{self.starts}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cpu_seconds(self) -> float:
        """User + system CPU time the operator process has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_kib(self) -> tuple[int, int]:
        """(current VmRSS, peak VmHWM) of the operator process in KiB."""
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
        return fields["VmRSS"], fields["VmHWM"]

    def stop(self) -> None:
        """SIGTERM (kopf stops cleanly), then SIGKILL if it has not exited within 15 s."""
        if not self.alive():
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()


def wait_for(kube, predicate, what: str, timeout: float = 60, op: OperatorProcess | None = None):
    """kube.wait_until, failing at once (with the log) if the operator died; the log tail on timeout."""
    def checked():
        if op is not None and not op.alive():
            raise RuntimeError(f"the operator exited:\n{op.log()[-3000:]}")
        return predicate()
    try:
        return kube.wait_until(checked, timeout=timeout, interval=0.3, what=what)
    except TimeoutError as e:
        raise TimeoutError(f"{e}\noperator log tail:\n{op.log()[-3000:] if op else ''}") from None


def names(kube, kind: str, ns: str, selector: str = "pdserve.io/inference-service=chat") -> list[str]:
    out = json.loads(kube.kubectl("get", kind, "-n", ns, "-l", selector, "-o", "json").stdout)
    return sorted(i["metadata"]["name"] for i in out["items"])


def settled_status(kube, ns: str, decode_ready: str, op: OperatorProcess | None = None, name: str = "chat") -> dict:
    """The InferenceService once its status reads decode_ready and carries observedGeneration.

    observedGeneration appears only when every pool (the router's Deployment too) exists, so a
    status written between the pools and the router reads the right decodeReady without it.
    """
    def settled():
        isvc = get_json(kube, "inferenceservice", name, "-n", ns) or {}
        status = isvc.get("status") or {}
        return isvc if status.get("decodeReady") == decode_ready and "observedGeneration" in status else None
    return wait_for(kube, settled, f"{name} status with decodeReady {decode_ready} and observedGeneration", op=op)
