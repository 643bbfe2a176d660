"""The configuration files of the one-node cluster (tests/harness/kube_node.py): containerd, CNI,
kubelet, kube-proxy, kube-scheduler. Pure functions: paths and ports in, file text out.

What this VM needs (cgroup v1, no CAP_SYS_RESOURCE, no registry, no systemd) is set here:
- containerd's CRI: `restrict_oom_score_adj` (else every sandbox fails on /proc/self/oom_score_adj),
  the sandbox image is the locally built pause image, network namespaces under its state dir;
- kubelet: `failCgroupV1: false`, `cgroupDriver: cgroupfs` under its own cgroup root,
  `address: 0.0.0.0` (the API server calls it for `kubectl logs`), no oom_score_adj change,
  every directory it writes under the work dir, image garbage collection and eviction off
  (the machine is shared: another program's disk use must not evict the test's pods);
- kube-proxy: iptables mode, without touching conntrack sysctls or route_localnet.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

NODE_NAME = "pdserve-node"
POD_CIDR = "10.244.0.0/24"  # the bridge's subnet (its gateway, the host, is .1)
POD_GATEWAY = "10.244.0.1"
MAX_PODS = 253  # addresses of POD_CIDR for pods: .2 to .254
BRIDGE = "pdsv0"
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins


def containerd_toml(root: Path, state: Path, socket: Path, cni_conf_dir: Path, sandbox_image: str) -> str:
    return f"""version = 2
root = "{root}"
state = "{state}"
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = false

[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{cni_conf_dir}"
  max_conf_num = 1
"""


def cni_conflist(ipam_dir: Path) -> str:
    """One bridge with the host as gateway; pods' traffic to the outside is masqueraded."""
    return json.dumps({
        "cniVersion": "1.0.0",
        "name": "pdserve-node",
        "plugins": [{
            "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                     "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(ipam_dir)},
        }],
    }, indent=2)


def kubelet_yaml(*, root_dir: Path, ca: Path, serving: tuple[Path, Path], runtime_socket: Path, cgroup_root: str,
                 port: int, healthz_port: int, logs_dir: Path, plugin_dir: Path, max_pods: int | None = None) -> str:
    """max_pods: the node's pod capacity (None: the kubelet's default, 110; POD_CIDR holds MAX_PODS)."""
    return yaml.safe_dump({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "0.0.0.0",
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "tlsCertFile": str(serving[1]),
        "tlsPrivateKeyFile": str(serving[0]),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{runtime_socket}",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "cgroupsPerQOS": True,
        "failSwapOn": False,
        "oomScoreAdj": 0,
        "podLogsDir": str(logs_dir),
        "volumePluginDir": str(plugin_dir),
        "resolvConf": "/etc/resolv.conf",
        "serializeImagePulls": False,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "0%", "imagefs.available": "0%",
                         "nodefs.inodesFree": "0%"},
        "protectKernelDefaults": False,
        "makeIPTablesUtilChains": False,
        "registerNode": True,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "shutdownGracePeriod": "0s",
        **({"maxPods": max_pods} if max_pods else {}),
    }, sort_keys=False)


def kube_proxy_yaml(*, kubeconfig: Path, healthz_port: int, metrics_port: int) -> str:
    return yaml.safe_dump({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": POD_CIDR,
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "oomScoreAdj": 0,
        # 0 leaves the machine's conntrack sysctls as they are
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"localhostNodePorts": False, "syncPeriod": "10s", "minSyncPeriod": "0s"},
    }, sort_keys=False)


def kube_scheduler_yaml(*, kubeconfig: Path) -> str:
    return yaml.safe_dump({
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "leaderElection": {"leaderElect": False},
    }, sort_keys=False)
