"""A real Kubernetes control plane for tests: etcd + kube-apiserver (RBAC on) + kube-controller-manager.

Tests get it through the session fixture `kube` (tests/conftest.py), which yields a
`KubeCluster`; every test that uses the fixture is marked `k8s` automatically.

    def test_something(kube):
        kube.kubectl("apply", "-f", "examples/x.yaml")                 # admin (system:masters)
        out = kube.kubectl("get", "pods", "-o", "json").stdout         # CompletedProcess, text
        kube.helm("install", "rel", "charts/pdserve", "-n", "ns", "--create-namespace")
        kc = kube.token_kubeconfig("ns", "pdserve-operator")           # a real ServiceAccount token:
        kube.kubectl("get", "pods", "-n", "ns", kubeconfig=kc)         #   RBAC applies to it
        api = kube.api_client()                                        # kubernetes.client.ApiClient
        kube.make_pods_ready("ns", "app=web", count=2)                 # simulated scheduler + kubelet
        kube.wait_until(lambda: ..., what="the pods to appear")

What runs (started by `local_control_plane`, all on 127.0.0.1, free ports, data in a temp dir):
- etcd (fsync off: the data is thrown away);
- kube-apiserver with `--authorization-mode=Node,RBAC`, serving certs from a CA made here with
  the openssl CLI, an admin client certificate in group system:masters, and a ServiceAccount
  signing key and issuer (so `kubectl create token` works);
- kube-controller-manager with its own identity (system:kube-controller-manager) and
  per-controller ServiceAccount credentials: the garbage collector, deployment, replicaset,
  serviceaccount(-token), endpoint(slice), namespace and root-CA publisher controllers run.
No kubelet and no scheduler: pods stay Pending, which is enough to test what creates them.
`kube.make_pods_ready(namespace, selector, count)` plays scheduler and kubelet for chosen pods
(bound to a Node that is only an API object, reported Ready with a 10.244.x.y IP, deletion
confirmed), so ready counts, Deployment status and EndpointSlices behave as in a real cluster;
the node lifecycle controller is off, as no kubelet renews that node's lease.

If the environment variable PDSERVE_KUBECONFIG names a kubeconfig, that existing cluster is
used instead and nothing is started (kubectl and helm still come from the tools' cache if
it has them, else from PATH).

The binaries come from `make k8s-tools` (tools/k8s/build.sh). If they are missing this fails
with KubeToolsMissing ("run make k8s-tools"): the k8s tests never skip silently.

Standalone: `.venv/bin/python tests/kube.py` starts a cluster, prints its kubeconfig and
runs until Ctrl-C (for developing the operator by hand).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import datetime
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import yaml

from procs import REPO, ProcessGroup, free_port, wait_for_port

BUILD_SCRIPT = REPO / "tools" / "k8s" / "build.sh"
CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")
CLIENT_BINARIES = ("kubectl", "helm")
SERVICE_CIDR = "10.96.0.0/16"  # virtual: nothing routes it (no kube-proxy); the first IP is kubernetes.default
START_TIMEOUT_S = 180.0


class KubeToolsMissing(RuntimeError):
    """The control-plane binaries are not built; the message says to run `make k8s-tools`."""


class KubeCommandError(subprocess.CalledProcessError):
    """A kubectl/helm command failed; str() shows its stdout and stderr."""

    def __str__(self) -> str:
        return f"{' '.join(map(str, self.cmd))} exited with {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


def tools_bin_dir() -> Path:
    """The directory tools/k8s/build.sh builds into (it is the one place that knows)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--bin-dir"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def require_tools(bin_dir: Path, names: tuple[str, ...]) -> None:
    missing = [n for n in names if not os.access(bin_dir / n, os.X_OK)]
    if missing:
        raise KubeToolsMissing(
            f"missing {', '.join(missing)} in {bin_dir}: run make k8s-tools (it builds them with Go once, then caches them)"
        )


@dataclass
class KubeCluster:
    """A reachable cluster and the clients for it. Every path here stays valid until the session ends.

    kubeconfig: admin kubeconfig (all permissions). server: the API server URL.
    bin_dir: the directory holding kubectl and helm. work_dir: where generated files go.
    """

    kubeconfig: Path
    server: str
    bin_dir: Path
    work_dir: Path
    local: bool = True  # started by this harness (False for PDSERVE_KUBECONFIG's cluster)
    _tokens: int = field(default=0, repr=False)
    _kubelet: "_FakeKubelet | None" = field(default=None, repr=False)

    def _env(self, kubeconfig: Path | None) -> dict[str, str]:
        env = dict(os.environ)
        helm_home = self.work_dir / "helm"
        env.update(
            KUBECONFIG=str(kubeconfig or self.kubeconfig),
            PATH=f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}",
            HELM_CACHE_HOME=str(helm_home / "cache"),
            HELM_CONFIG_HOME=str(helm_home / "config"),
            HELM_DATA_HOME=str(helm_home / "data"),
        )
        return env

    def _run(self, tool: str, args, input, check, kubeconfig, timeout) -> subprocess.CompletedProcess:
        cmd = [str(self.bin_dir / tool), *map(str, args)]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, env=self._env(kubeconfig), timeout=timeout)
        if check and proc.returncode != 0:
            raise KubeCommandError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def kubectl(self, *args, input: str | None = None, check: bool = True, kubeconfig: Path | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run kubectl (as admin unless `kubeconfig` is given); raises KubeCommandError on failure if check."""
        return self._run("kubectl", args, input, check, kubeconfig, timeout)

    def helm(self, *args, input: str | None = None, check: bool = True, kubeconfig: Path | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
        """Run helm 4 (as admin unless `kubeconfig` is given), with its cache/config under work_dir."""
        return self._run("helm", args, input, check, kubeconfig, timeout)

    def token_kubeconfig(self, namespace: str, sa_name: str, duration: str = "6h") -> Path:
        """A kubeconfig that authenticates as ServiceAccount namespace/sa_name with a real token.

        The token comes from the TokenRequest API (`kubectl create token`), so the API server
        checks it and RBAC decides what it may do. The ServiceAccount must exist.
        """
        token = self.kubectl("create", "token", sa_name, "-n", namespace, f"--duration={duration}").stdout.strip()
        admin = json.loads(self.kubectl("config", "view", "--raw", "--minify", "--flatten", "-o", "json").stdout)
        cluster = admin["clusters"][0]["cluster"]
        user = f"system:serviceaccount:{namespace}:{sa_name}"
        self._tokens += 1
        path = self.work_dir / f"token-{self._tokens}-{namespace}-{sa_name}.kubeconfig"
        _write_kubeconfig(path, cluster, user, {"token": token}, namespace)
        return path

    def api_client(self, kubeconfig: Path | None = None):
        """A kubernetes.client.ApiClient for the admin (or for `kubeconfig`); the caller closes it."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def make_pods_ready(self, namespace: str, selector: str, count: int = 1, timeout: float = 60.0) -> list[str]:
        """Wait for at least `count` pods matching label `selector`, then make every one of them Ready.

        The local control plane has no scheduler and no kubelet, so this does their part: it binds
        each pod to the Node `pdserve-test-node` (an API object only), reports it Running and
        Ready with a pod IP from 10.244.0.0/16, and from then on force-deletes it once it is
        deleted (as a kubelet confirms a pod's termination). Controllers see real ready pods:
        ReplicaSet/Deployment ready counts rise and EndpointSlices list their IPs. Nothing runs.
        On an existing cluster (PDSERVE_KUBECONFIG) its kubelets do this; here it only waits.
        Returns the names of the ready pods.
        """
        def pods() -> list[dict]:
            return json.loads(self.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]

        def ready(pod: dict) -> bool:
            return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))

        def live(only_ready: bool = False) -> list[dict] | None:  # None until there are `count`
            ps = [p for p in pods() if not p["metadata"].get("deletionTimestamp") and (ready(p) or not only_ready)]
            return ps if len(ps) >= count else None

        found = self.wait_until(live, timeout, what=f"{count} pods matching {selector} in {namespace}")
        if self.local:
            if self._kubelet is None:
                self._kubelet = _FakeKubelet(self)
            for pod in found:
                if not ready(pod):
                    self._kubelet.run_pod(pod)
        return [p["metadata"]["name"] for p in self.wait_until(
            lambda: live(only_ready=True), timeout, what=f"{count} ready pods matching {selector} in {namespace}")]

    def close(self) -> None:
        """Stop what this object started in the test process (the fake kubelet); not the cluster."""
        if self._kubelet is not None:
            self._kubelet.stop()
            self._kubelet = None

    @staticmethod
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


class _FakeKubelet:
    """The kubelet part of make_pods_ready: one Node object, pods reported running, deletions confirmed.

    A daemon thread polls the pods bound to the node and force-deletes those being deleted
    (a kubelet would stop their containers, then do the same); stop() ends it.
    """

    NODE = "pdserve-test-node"

    def __init__(self, cluster: KubeCluster):
        from kubernetes import client

        self.api_client = cluster.api_client()
        self.core = client.CoreV1Api(self.api_client)
        self.next_ip = 0
        if not self.core.list_node(field_selector=f"metadata.name={self.NODE}").items:
            self.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.NODE}})
        now = _now()
        self.core.patch_node_status(self.NODE, {"status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "pdserve test harness",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "capacity": {"cpu": "64", "memory": "256Gi", "pods": "500"},
            "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "500"},
        }})
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._confirm_deletions, name="fake-kubelet", daemon=True)
        self.thread.start()

    def run_pod(self, pod: dict) -> None:
        name, namespace = pod["metadata"]["name"], pod["metadata"]["namespace"]
        if not pod["spec"].get("nodeName"):
            # The binding subresource is what the scheduler uses; the client's Binding model
            # cannot read the response (a Status), hence _preload_content=False.
            self.core.create_namespaced_binding(namespace, {
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.NODE}}, _preload_content=False)
        self.next_ip += 1
        ip = f"10.244.{self.next_ip // 250}.{self.next_ip % 250 + 1}"
        now = _now()
        conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                      for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
        statuses = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": True, "started": True,
                     "restartCount": 0, "state": {"running": {"startedAt": now}}} for c in pod["spec"]["containers"]]
        self.core.patch_namespaced_pod_status(name, namespace, {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "10.244.255.1",
            "hostIPs": [{"ip": "10.244.255.1"}], "startTime": now, "conditions": conditions, "containerStatuses": statuses}})

    def _confirm_deletions(self) -> None:
        from kubernetes.client.rest import ApiException

        while not self.stopping.wait(0.3):
            try:
                for pod in self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.NODE}").items:
                    if pod.metadata.deletion_timestamp is not None:
                        with contextlib.suppress(ApiException):  # already gone
                            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
            except Exception:  # the API server is stopping, or a transient error: try again next round
                continue

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        self.api_client.close()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write_kubeconfig(path: Path, cluster: dict, user: str, credentials: dict, namespace: str = "default") -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "pdserve-test", "cluster": cluster}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "pdserve-test", "context": {"cluster": "pdserve-test", "user": user, "namespace": namespace}}],
        "current-context": "pdserve-test",
    }
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


class _Pki:
    """A throwaway CA and the certificates/keys the control plane needs, made with the openssl CLI."""

    def __init__(self, d: Path):
        self.d = d
        d.mkdir(parents=True, exist_ok=True)
        self.ca = self._cert("ca", "pdserve-test-ca", ca=True)
        self.serving = self._cert("apiserver", "kube-apiserver", ext="serverAuth", san=[
            "IP:127.0.0.1", "DNS:localhost", "IP:10.96.0.1", "DNS:kubernetes", "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"])
        self.admin = self._cert("admin", "pdserve-admin", org="system:masters", ext="clientAuth")
        self.controller_manager = self._cert("controller-manager", "system:kube-controller-manager", ext="clientAuth")
        # The ServiceAccount token signing key pair (RS256, the default every client expects).
        self.sa_key, self.sa_pub = d / "sa.key", d / "sa.pub"
        _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", self.sa_key)
        _openssl("pkey", "-in", self.sa_key, "-pubout", "-out", self.sa_pub)

    def _cert(self, name, cn, org=None, ext=None, san=(), ca=False) -> tuple[Path, Path]:
        key, crt, cnf = self.d / f"{name}.key", self.d / f"{name}.crt", self.d / f"{name}.cnf"
        subject = f"CN = {cn}" + (f"\nO = {org}" if org else "")
        exts = ["basicConstraints = critical, CA:TRUE", "keyUsage = critical, keyCertSign, cRLSign"] if ca else [
            "basicConstraints = critical, CA:FALSE", "keyUsage = critical, digitalSignature",
            f"extendedKeyUsage = {ext}"] + ([f"subjectAltName = {', '.join(san)}"] if san else [])
        cnf.write_text("[req]\nprompt = no\ndistinguished_name = dn\n[dn]\n" + subject + "\n[ext]\n" + "\n".join(exts) + "\n")
        newkey = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key]
        if ca:
            _openssl("req", "-x509", *newkey, "-config", cnf, "-extensions", "ext", "-days", "30", "-out", crt)
        else:
            csr = self.d / f"{name}.csr"
            _openssl("req", "-new", *newkey, "-config", cnf, "-out", csr)
            _openssl("x509", "-req", "-in", csr, "-CA", self.ca[1], "-CAkey", self.ca[0], "-set_serial",
                     str(int.from_bytes(os.urandom(8), "big")), "-days", "30", "-extfile", cnf, "-extensions", "ext", "-out", crt)
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
def local_control_plane(work_dir: Path, bin_dir: Path | None = None) -> Iterator[KubeCluster]:
    """Start etcd, kube-apiserver and kube-controller-manager; yield the cluster; stop them all.

    Returns once /readyz is ok and the ServiceAccount `default/default` exists (the controller
    manager runs). The processes are stopped on exit, also when start-up or the body fails;
    their logs stay in work_dir/logs.
    """
    bin_dir = bin_dir or tools_bin_dir()
    require_tools(bin_dir, CONTROL_PLANE_BINARIES + CLIENT_BINARIES)
    work_dir.mkdir(parents=True, exist_ok=True)
    pki = _Pki(work_dir / "pki")
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
            str(bin_dir / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--cert-dir={work_dir / 'pki'}", f"--tls-cert-file={pki.serving[1]}", f"--tls-private-key-file={pki.serving[0]}",
            f"--client-ca-file={pki.ca[1]}", "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--profiling=false", "--v=1",
        ], name="kube-apiserver", preexec_fn=_die_with_parent)

        cm_kubeconfig = work_dir / "controller-manager.kubeconfig"
        cluster_entry = {"server": server, "certificate-authority-data": _b64(pki.ca[1])}
        _write_kubeconfig(cm_kubeconfig, cluster_entry, "system:kube-controller-manager",
                          {"client-certificate-data": _b64(pki.controller_manager[1]),
                           "client-key-data": _b64(pki.controller_manager[0])}, "kube-system")
        admin_kubeconfig = work_dir / "admin.kubeconfig"
        _write_kubeconfig(admin_kubeconfig, cluster_entry, "pdserve-admin",
                          {"client-certificate-data": _b64(pki.admin[1]), "client-key-data": _b64(pki.admin[0])})
        # Started at once: it retries until the API server answers, which overlaps their start-up.
        controller_manager = group.start([
            str(bin_dir / "kube-controller-manager"), f"--kubeconfig={cm_kubeconfig}", "--secure-port=0",
            "--leader-elect=false", f"--root-ca-file={pki.ca[1]}", f"--service-account-private-key-file={pki.sa_key}",
            "--use-service-account-credentials=true", f"--service-cluster-ip-range={SERVICE_CIDR}", "--v=1",
            # No kubelet renews node leases: the node lifecycle controller would mark the fake
            # node of make_pods_ready NotReady (and its pods unready) after 50 s.
            "--controllers=*,-node-lifecycle-controller",
        ], name="kube-controller-manager", preexec_fn=_die_with_parent)

        ctx = ssl.create_default_context(cafile=str(pki.ca[1]))
        ctx.load_cert_chain(str(pki.admin[1]), str(pki.admin[0]))

        def up(path: str) -> bool:
            for name, proc in (("etcd", etcd), ("kube-apiserver", apiserver), ("kube-controller-manager", controller_manager)):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; its log ends:\n{_log_tail(logs / f'{name}.log')}")
            return _https_get(server + path, ctx) == 200

        try:
            KubeCluster.wait_until(lambda: up("/readyz"), START_TIMEOUT_S, 0.25, "kube-apiserver /readyz")
            KubeCluster.wait_until(lambda: up("/api/v1/namespaces/default/serviceaccounts/default"), START_TIMEOUT_S, 0.25,
                                   "the controller manager to create ServiceAccount default/default")
        except TimeoutError as e:
            tails = "\n".join(f"--- {n} ---\n{_log_tail(logs / f'{n}.log')}" for n in CONTROL_PLANE_BINARIES)
            raise TimeoutError(f"{e}\n{tails}") from None
        cluster = KubeCluster(kubeconfig=admin_kubeconfig, server=server, bin_dir=bin_dir, work_dir=work_dir)
        try:
            yield cluster
        finally:
            cluster.close()
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


def existing_cluster(kubeconfig: Path, work_dir: Path) -> KubeCluster:
    """A KubeCluster for a cluster someone else runs (PDSERVE_KUBECONFIG); nothing is started."""
    if not kubeconfig.is_file():
        raise FileNotFoundError(f"PDSERVE_KUBECONFIG={kubeconfig}: no such file")
    bin_dir = tools_bin_dir()
    if not all(os.access(bin_dir / n, os.X_OK) for n in CLIENT_BINARIES):
        import shutil

        found = {n: shutil.which(n) for n in CLIENT_BINARIES}
        dirs = {Path(p).parent for p in found.values() if p}
        if len(dirs) != 1 or not all(found.values()):
            raise KubeToolsMissing(f"kubectl and helm are not both in {bin_dir} or in one PATH directory: run make k8s-tools")
        bin_dir = dirs.pop()
    work_dir.mkdir(parents=True, exist_ok=True)
    cluster = KubeCluster(kubeconfig=kubeconfig, server="", bin_dir=bin_dir, work_dir=work_dir, local=False)
    cluster.server = cluster.kubectl("config", "view", "--minify", "-o", "jsonpath={.clusters[0].cluster.server}").stdout
    return cluster


@contextlib.contextmanager
def kube_cluster(work_dir: Path) -> Iterator[KubeCluster]:
    """The cluster for the tests: PDSERVE_KUBECONFIG's if set, else a local control plane."""
    env = os.environ.get("PDSERVE_KUBECONFIG")
    if env:
        yield existing_cluster(Path(env), work_dir)
    else:
        with local_control_plane(work_dir) as cluster:
            yield cluster


def _main() -> None:
    # SIGINT (also when started in the background, where it is ignored by default) and SIGTERM
    # leave through the `with`, which stops the control plane in order.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: sys.exit(0))
    start = time.monotonic()
    with local_control_plane(Path(tempfile.mkdtemp(prefix="pdserve-kube-"))) as cluster:
        print(f"control plane up in {time.monotonic() - start:.1f}s at {cluster.server}")
        print(f"export KUBECONFIG={cluster.kubeconfig}   (kubectl and helm are in {cluster.bin_dir}); "
              "Ctrl-C or SIGTERM stops it", flush=True)
        while True:
            signal.pause()


if __name__ == "__main__":
    _main()
