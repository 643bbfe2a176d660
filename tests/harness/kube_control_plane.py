"""Start and stop the local control plane: etcd, kube-apiserver (RBAC), kube-controller-manager.

tests/harness/kube.py is the API the tests use; this module only knows processes, ports and keys.
All listen on 127.0.0.1 on free ports; certificates, data and logs go under work_dir. For a real
node (tests/harness/kube_node.py) `control_plane(..., node_ip=...)` makes the API server listen on
every address and publish node_ip as the endpoint of Service default/kubernetes (pods reach it
through kube-proxy), lets it call the kubelet (logs, exec) and runs every controller.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import yaml

from pdserve.net import free_port
from harness.procs import REPO, ProcessGroup, wait_for_port

BUILD_SCRIPT = REPO / "tools" / "k8s" / "build.sh"
CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")
CLIENT_BINARIES = ("kubectl", "helm")
SERVICE_CIDR = "10.96.0.0/16"  # routed only by a real node's kube-proxy; the first IP is kubernetes.default
START_TIMEOUT_S = 180.0
CM_STARTS = 3  # times the controller manager is started before its exit fails the start-up


class KubeToolsMissing(RuntimeError):
    """The control-plane binaries are not built; the message says to run `make k8s-tools`."""


def tools_bin_dir() -> Path:
    """The directory tools/k8s/build.sh builds into (it is the one place that knows)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--bin-dir"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def require_tools(bin_dir: Path, names: tuple[str, ...]) -> None:
    missing = [n for n in names if not os.access(bin_dir / n, os.X_OK)]
    if missing:
        raise KubeToolsMissing(
            f"missing {', '.join(missing)} in {bin_dir}: run make k8s-tools (it builds them with "
            f"Go once, then caches them)"
        )


def wait_until(predicate: Callable[[], object], timeout: float = 60.0, interval: float = 0.2, what: str = "condition"):
    """Poll predicate until it returns something truthy (returned); TimeoutError names `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass(frozen=True)
class ControlPlane:
    """Where a started control plane is: its API server URL and admin kubeconfig (system:masters)."""

    server: str
    kubeconfig: Path
    bin_dir: Path
    work_dir: Path
    pki: "Pki"


def write_kubeconfig(path: Path, cluster: dict, user: str, credentials: dict, namespace: str = "default") -> None:
    """Write a one-context kubeconfig (mode 0600): `cluster` is its cluster entry, `credentials` its user entry."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "pdserve-test", "cluster": cluster}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "pdserve-test",
                      "context": {"cluster": "pdserve-test", "user": user, "namespace": namespace}}],
        "current-context": "pdserve-test",
    }
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


class Pki:
    """A throwaway CA and the certificates/keys the control plane needs, made with the openssl CLI.

    cert(name, cn, org=..., ext="clientAuth"|"serverAuth", san=[...]) issues another one, signed by
    the same CA, as (key path, certificate path).
    """

    def __init__(self, d: Path, extra_san: tuple[str, ...] = ()):
        self.d = d
        d.mkdir(parents=True, exist_ok=True)
        self.ca = self.cert("ca", "pdserve-test-ca", ca=True)
        self.serving = self.cert("apiserver", "kube-apiserver", ext="serverAuth", san=[
            "IP:127.0.0.1", "DNS:localhost", "IP:10.96.0.1", "DNS:kubernetes", "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local", *extra_san])
        self.admin = self.cert("admin", "pdserve-admin", org="system:masters", ext="clientAuth")
        self.controller_manager = self.cert("controller-manager", "system:kube-controller-manager", ext="clientAuth")
        # The ServiceAccount token signing key pair (RS256, the default every client expects).
        self.sa_key, self.sa_pub = d / "sa.key", d / "sa.pub"
        _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", self.sa_key)
        _openssl("pkey", "-in", self.sa_key, "-pubout", "-out", self.sa_pub)

    def cert(self, name, cn, org=None, ext=None, san=(), ca=False) -> tuple[Path, Path]:
        key, crt, cnf = self.d / f"{name}.key", self.d / f"{name}.crt", self.d / f"{name}.cnf"
        subject = f"CN = {cn}" + (f"\nO = {org}" if org else "")
        exts = ["basicConstraints = critical, CA:TRUE", "keyUsage = critical, keyCertSign, cRLSign"] if ca else [
            "basicConstraints = critical, CA:FALSE", "keyUsage = critical, digitalSignature",
            f"extendedKeyUsage = {ext}"] + ([f"subjectAltName = {', '.join(san)}"] if san else [])
        cnf.write_text("[req]\nprompt = "
                       "no\ndistinguished_name = dn\n[dn]\n" + subject + "\n[ext]\n" + "\n".join(exts) + "\n")
        newkey = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key]
        if ca:
            _openssl("req", "-x509", *newkey, "-config", cnf, "-extensions", "ext", "-days", "30", "-out", crt)
        else:
            csr = self.d / f"{name}.csr"
            _openssl("req", "-new", *newkey, "-config", cnf, "-out", csr)
            _openssl("x509", "-req", "-in", csr, "-CA", self.ca[1], "-CAkey", self.ca[0], "-set_serial",
                     str(int.from_bytes(os.urandom(8), "big")), "-days", "30", "-extfile", cnf, "-extensions", "ext",
                     "-out", crt)
        return key, crt


def _openssl(*args) -> None:
    proc = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(map(str, args))} failed:\n{proc.stderr}")


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the test process dies, so no control plane outlives a killed run."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _https_get(url: str, ctx: ssl.SSLContext) -> int:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


@contextlib.contextmanager
def control_plane(work_dir: Path, bin_dir: Path | None = None, node_ip: str | None = None) -> Iterator[ControlPlane]:
    """Start etcd, kube-apiserver and kube-controller-manager; yield where they are; stop them all.

    Returns once /readyz is ok and the ServiceAccount `default/default` exists (the controller
    manager runs). The processes are stopped on exit, also when start-up or the body fails;
    their logs stay in work_dir/logs. node_ip: see the module docstring (None: loopback only,
    no kubelet, no node lifecycle controller).
    """
    bin_dir = bin_dir or tools_bin_dir()
    require_tools(bin_dir, CONTROL_PLANE_BINARIES + CLIENT_BINARIES)
    work_dir.mkdir(parents=True, exist_ok=True)
    pki = Pki(work_dir / "pki", extra_san=(f"IP:{node_ip}",) if node_ip else ())
    if node_ip:
        kubelet_client = pki.cert("apiserver-kubelet-client", "kube-apiserver-kubelet-client", org="system:masters",
                                  ext="clientAuth")
        node_args = ["--bind-address=0.0.0.0", f"--advertise-address={node_ip}",
                     f"--kubelet-client-certificate={kubelet_client[1]}", f"--kubelet-client-key={kubelet_client[0]}",
                     "--kubelet-preferred-address-types=InternalIP"]
        controllers = "*"  # the node lifecycle controller removes the new node's not-ready taint
    else:
        node_args = ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                     # Endpoints may not name a loopback address: without this the API server fails every
                     # 10 s to publish itself as the endpoint of Service default/kubernetes.
                     "--endpoint-reconciler-type=none"]
        # No kubelet renews node leases: the node lifecycle controller would mark the fake
        # node of make_pods_ready NotReady (and its pods unready) after 50 s.
        controllers = "*,-node-lifecycle-controller"
    logs = work_dir / "logs"
    group = ProcessGroup(log_dir=logs)
    try:
        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        etcd = group.start([
            str(bin_dir / "etcd"), "--name=pdserve-test", f"--data-dir={work_dir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}", f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=pdserve-test=http://127.0.0.1:{etcd_peer}", "--unsafe-no-fsync", "--log-level=warn",
        ], name="etcd", preexec_fn=_die_with_parent)
        wait_for_port(etcd_port, timeout=30, proc=etcd)

        server = f"https://127.0.0.1:{api_port}"
        apiserver = group.start([
            str(bin_dir / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}", *node_args,
            f"--secure-port={api_port}",
            f"--cert-dir={work_dir / 'pki'}", f"--tls-cert-file={pki.serving[1]}",
            f"--tls-private-key-file={pki.serving[0]}",
            f"--client-ca-file={pki.ca[1]}", "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--profiling=false", "--v=1",
        ], name="kube-apiserver", preexec_fn=_die_with_parent)

        cm_kubeconfig = work_dir / "controller-manager.kubeconfig"
        cluster_entry = {"server": server, "certificate-authority-data": _b64(pki.ca[1])}
        write_kubeconfig(cm_kubeconfig, cluster_entry, "system:kube-controller-manager",
                         {"client-certificate-data": _b64(pki.controller_manager[1]),
                          "client-key-data": _b64(pki.controller_manager[0])}, "kube-system")
        admin_kubeconfig = work_dir / "admin.kubeconfig"
        write_kubeconfig(admin_kubeconfig, cluster_entry, "pdserve-admin",
                         {"client-certificate-data": _b64(pki.admin[1]), "client-key-data": _b64(pki.admin[0])})
        # Started at once: it retries until the API server answers, which overlaps their start-up. On a
        # loaded box the API server can still lack its bootstrap RBAC roles when the controller manager's
        # 10 s wait for /healthz ends ("forbidden"): it exits, and is started again (CM_STARTS in all).
        cm_argv = [
            str(bin_dir / "kube-controller-manager"), f"--kubeconfig={cm_kubeconfig}", "--secure-port=0",
            "--leader-elect=false", f"--root-ca-file={pki.ca[1]}", f"--service-account-private-key-file={pki.sa_key}",
            "--use-service-account-credentials=true", f"--service-cluster-ip-range={SERVICE_CIDR}", "--v=1",
            f"--controllers={controllers}",
        ]
        cm = {"proc": group.start(cm_argv, name="kube-controller-manager", preexec_fn=_die_with_parent), "starts": 1,
              "name": "kube-controller-manager"}

        ctx = ssl.create_default_context(cafile=str(pki.ca[1]))
        ctx.load_cert_chain(str(pki.admin[1]), str(pki.admin[0]))

        def up(path: str) -> bool:
            if cm["proc"].poll() is not None and cm["starts"] < CM_STARTS:
                cm["starts"] += 1
                cm["name"] = f"kube-controller-manager-{cm['starts']}"
                cm["proc"] = group.start(cm_argv, name=cm["name"], preexec_fn=_die_with_parent)
            for name, proc in (("etcd", etcd), ("kube-apiserver", apiserver), (cm["name"], cm["proc"])):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; its log "
                                       f"ends:\n{_log_tail(logs / f'{name}.log')}")
            return _https_get(server + path, ctx) == 200

        try:
            wait_until(lambda: up("/readyz"), START_TIMEOUT_S, 0.25, "kube-apiserver /readyz")
            wait_until(lambda: up("/api/v1/namespaces/default/serviceaccounts/default"), START_TIMEOUT_S, 0.25,
                       "the controller manager to create ServiceAccount default/default")
        except TimeoutError as e:
            tails = "\n".join(f"--- {n} ---\n{_log_tail(logs / f'{n}.log')}" for n in CONTROL_PLANE_BINARIES)
            raise TimeoutError(f"{e}\n{tails}") from None
        yield ControlPlane(server=server, kubeconfig=admin_kubeconfig, bin_dir=bin_dir, work_dir=work_dir, pki=pki)
    finally:
        # Clients first, etcd last: stopped together, the API server waits for etcd's
        # connections and etcd for the API server's (about 10 s); in order it takes about 1 s.
        for proc in reversed(group.procs):
            _stop(proc)
        group.close()


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
