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
(bound to a Node that is only an API object, reported Ready with a 10.245.x.y IP (harness/kube_kubelet.py), deletion
confirmed), so ready counts, Deployment status and EndpointSlices behave as in a real cluster;
the node lifecycle controller is off, as no kubelet renews that node's lease.

If the environment variable PDSERVE_KUBECONFIG names a kubeconfig, that existing cluster is
used instead and nothing is started (kubectl and helm still come from the tools' cache if
it has them, else from PATH).

The binaries come from `make k8s-tools` (tools/k8s/build.sh). If they are missing this fails
with KubeToolsMissing ("run make k8s-tools"): the k8s tests never skip silently.

Standalone: `.venv/bin/python tests/harness/kube.py` starts a cluster, prints its kubeconfig and
runs until Ctrl-C (for developing the operator by hand).

Read next: kube_control_plane.py (processes, ports, certificates), kube_kubelet.py (the
stand-in kubelet of make_pods_ready), tools/k8s/README.md (how the binaries are built).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from harness.kube_control_plane import (CLIENT_BINARIES, KubeToolsMissing, control_plane, require_tools, tools_bin_dir,
                                wait_until, write_kubeconfig)
from harness.kube_kubelet import FakeKubelet

__all__ = ["KubeCluster", "KubeCommandError", "KubeToolsMissing", "kube_cluster", "local_control_plane",
           "existing_cluster", "require_tools", "tools_bin_dir", "wait_until"]


class KubeCommandError(subprocess.CalledProcessError):
    """A kubectl/helm command failed; str() shows its stdout and stderr."""

    def __str__(self) -> str:
        return (f"{' '.join(map(str, self.cmd))} exited with {self.returncode}\n"
                f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}")


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
    _kubelet: "FakeKubelet | None" = field(default=None, repr=False)

    # kube.wait_until(predicate, timeout=60, interval=0.2, what=...): poll until truthy, return it.
    wait_until = staticmethod(wait_until)

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
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, env=self._env(kubeconfig),
                              timeout=timeout)
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
        write_kubeconfig(path, cluster, user, {"token": token}, namespace)
        return path

    def api_client(self, kubeconfig: Path | None = None):
        """A kubernetes.client.ApiClient for the admin (or for `kubeconfig`); the caller closes it."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def make_pods_ready(self, namespace: str, selector: str, count: int = 1, timeout: float = 60.0) -> list[str]:
        """Wait for at least `count` pods matching label `selector`, then make every one of them Ready.

        The local control plane has no scheduler and no kubelet, so this does their part: it binds
        each pod to the Node `pdserve-test-node` (an API object only), reports it Running and
        Ready with a pod IP from 10.245.0.0/16, and from then on force-deletes it once it is
        deleted (as a kubelet confirms a pod's termination). Controllers see real ready pods:
        ReplicaSet/Deployment ready counts rise and EndpointSlices list their IPs. Nothing runs.
        On an existing cluster (PDSERVE_KUBECONFIG) its kubelets do this; here it only waits.
        Returns the names of the ready pods.
        """
        def pods() -> list[dict]:
            return json.loads(self.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o",
                                           "json").stdout)["items"]

        def ready(pod: dict) -> bool:
            return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))

        def live(only_ready: bool = False) -> list[dict] | None:  # None until there are `count`
            ps = [p for p in pods() if not p["metadata"].get("deletionTimestamp") and (ready(p) or not only_ready)]
            return ps if len(ps) >= count else None

        found = self.wait_until(live, timeout, what=f"{count} pods matching {selector} in {namespace}")
        if self.local:
            if self._kubelet is None:
                self._kubelet = FakeKubelet(self.api_client())
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


@contextlib.contextmanager
def local_control_plane(work_dir: Path, bin_dir: Path | None = None) -> Iterator[KubeCluster]:
    """Start the local control plane (kube_control_plane.py), yield a KubeCluster for it, stop it.

    Returns once /readyz is ok and ServiceAccount default/default exists. Everything is
    stopped on exit, also when start-up or the body fails; logs stay in work_dir/logs.
    Raises KubeToolsMissing ("run make k8s-tools") when the binaries are not built.
    """
    with control_plane(work_dir, bin_dir) as cp:
        cluster = KubeCluster(kubeconfig=cp.kubeconfig, server=cp.server, bin_dir=cp.bin_dir, work_dir=cp.work_dir)
        try:
            yield cluster
        finally:
            cluster.close()


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
            raise KubeToolsMissing(f"kubectl and helm are not both in {bin_dir} or in one PATH "
                                   f"directory: run make k8s-tools")
        bin_dir = dirs.pop()
    work_dir.mkdir(parents=True, exist_ok=True)
    cluster = KubeCluster(kubeconfig=kubeconfig, server="", bin_dir=bin_dir, work_dir=work_dir, local=False)
    cluster.server = cluster.kubectl("config", "view", "--minify", "-o",
                                     "jsonpath={.clusters[0].cluster.server}").stdout
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
