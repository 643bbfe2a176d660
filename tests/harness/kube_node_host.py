"""What the one-node cluster changes on the machine, and how it is put back (tests/harness/kube_node.py).

A real node is not contained in a temp dir: containerd, runc, the bridge CNI plugin, the kubelet
and kube-proxy change machine-wide state. This module knows all of it and undoes it:
- sysctls (ip_forward, bridge-nf-call-iptables, the kubelet's kernel tunables): `Sysctls` records
  their values before and writes back those that changed;
- iptables chains KUBE-* (kube-proxy, kubelet) and CNI-* (bridge plugin) in every table of both
  address families, with the rules in other chains that jump to them;
- mounts under the cluster's directories (pod volumes, container root file systems, network
  namespaces, sandbox /dev/shm), deepest first;
- the bridge, the cgroup root of the kubelet in every hierarchy, /var/log/containers links.
Only one such cluster can run on a machine at a time (the chains have fixed names):
`machine_lock()` makes a second one wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Iterator

LOCK_PATH = Path("/run/lock/pdserve-node-cluster.lock")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CHAIN_PREFIXES = ("KUBE-", "CNI-")
# What the bridge plugin, kube-proxy and the kubelet (setupKernelTunables) may set.
SYSCTLS = (
    "net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding", "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables", "net/ipv4/conf/all/route_localnet", "vm/overcommit_memory",
    "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops", "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes", "net/netfilter/nf_conntrack_max",
)


class MachineBusy(RuntimeError):
    """Another one-node cluster holds the machine for longer than we wait."""


@contextlib.contextmanager
def machine_lock(timeout: float = 1800.0) -> Iterator[None]:
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_PATH, "w") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise MachineBusy(f"another one-node cluster held {LOCK_PATH} for {timeout:.0f}s") from None
                time.sleep(2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def host_ip() -> str:
    """The address of the interface the default route leaves by (the node's InternalIP)."""
    out = subprocess.run(["ip", "-j", "route", "get", "1.1.1.1"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]["prefsrc"]


class Sysctls:
    """Values of SYSCTLS when created; restore() writes back every one that changed."""

    def __init__(self) -> None:
        self.saved = {k: v for k in SYSCTLS if (v := self.read(k)) is not None}

    @staticmethod
    def read(key: str) -> str | None:
        try:
            return Path("/proc/sys", key).read_text().strip()
        except OSError:
            return None

    @staticmethod
    def write(key: str, value: str) -> None:
        Path("/proc/sys", key).write_text(value + "\n")

    def changed(self) -> dict[str, tuple[str, str | None]]:
        return {k: (v, now) for k, v in self.saved.items() if (now := self.read(k)) != v}

    def restore(self) -> list[str]:
        problems = []
        for key, (value, _) in self.changed().items():
            try:
                self.write(key, value)
            except OSError as e:
                problems.append(f"sysctl {key}: cannot restore {value}: {e}")
        return problems


def _ours(chain: str) -> bool:
    return chain.startswith(CHAIN_PREFIXES)


def iptables_leftovers() -> list[str]:
    """'<tool> <table> <chain>' for every KUBE-*/CNI-* chain that exists."""
    found = []
    for tool in ("iptables", "ip6tables"):
        table = None
        for line in _run_out([f"{tool}-save"]).splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":") and _ours(line[1:].split()[0]):
                found.append(f"{tool} {table} {line[1:].split()[0]}")
    return found


def iptables_rules(table: str) -> list[str]:
    """The IPv4 rules of `table` as iptables-save writes them ('-A CHAIN ...')."""
    return [line for line in _run_out(["iptables-save", "-t", table]).splitlines() if line.startswith("-A ")]


def remove_iptables_chains() -> list[str]:
    """Delete the rules that jump to KUBE-*/CNI-* chains, then flush and delete those chains."""
    problems = []
    for tool in ("iptables", "ip6tables"):
        table = None
        jumps: list[tuple[str, str]] = []
        chains: list[tuple[str, str]] = []
        for line in _run_out([f"{tool}-save"]).splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":") and _ours(name := line[1:].split()[0]):
                chains.append((table, name))
            elif line.startswith("-A ") and not _ours(line.split()[1]) and re.search(r" -[jg] (KUBE-|CNI-)", line):
                jumps.append((table, line[3:]))
        for table, rule in jumps:
            proc = subprocess.run(f"{tool} -w -t {table} -D {rule}", shell=True, capture_output=True, text=True)
            if proc.returncode != 0:
                problems.append(f"{tool} -t {table} -D {rule}: {proc.stderr.strip()}")
        for op in ("-F", "-X"):
            for table, name in chains:
                proc = subprocess.run([tool, "-w", "-t", table, op, name], capture_output=True, text=True)
                if proc.returncode != 0 and op == "-X":
                    problems.append(f"{tool} -t {table} -X {name}: {proc.stderr.strip()}")
    return problems


def mounts_under(*roots: Path) -> list[str]:
    """Mount points under any of `roots`, deepest first."""
    prefixes = tuple(str(r.resolve()) for r in roots)
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point.startswith(prefixes):
            points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def unmount_under(*roots: Path) -> list[str]:
    problems = []
    for _ in range(3):  # a mount can hide another at the same point
        for point in mounts_under(*roots):
            proc = subprocess.run(["umount", "-l", point], capture_output=True, text=True)
            if proc.returncode != 0:
                problems.append(f"umount {point}: {proc.stderr.strip()}")
        if not mounts_under(*roots):
            return []
    return problems + [f"still mounted: {p}" for p in mounts_under(*roots)]


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def delete_link(name: str) -> list[str]:
    if not link_exists(name):
        return []
    proc = subprocess.run(["ip", "link", "delete", name], capture_output=True, text=True)
    return [] if proc.returncode == 0 else [f"ip link delete {name}: {proc.stderr.strip()}"]


def cgroup_dirs(name: str) -> list[Path]:
    """The cgroup `name` (a top-level cgroup) and everything under it, in every hierarchy, deepest first."""
    dirs = []
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / name
        if top.is_dir():
            dirs += [Path(d) for d, _, _ in os.walk(top)]
    return sorted(dirs, key=lambda p: len(p.parts), reverse=True)


def make_cgroup_root(name: str) -> None:
    """Create the kubelet's cgroup root in every v1 hierarchy (it must exist; cpuset needs cpus and mems)."""
    for hierarchy in CGROUP_ROOT.iterdir():
        if not hierarchy.is_dir() or hierarchy.name == "unified" or not (hierarchy / "cgroup.procs").exists():
            continue
        top = hierarchy / name
        top.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (hierarchy / knob).exists() and not (top / knob).read_text().strip():
                (top / knob).write_text((hierarchy / knob).read_text())


def remove_cgroups(name: str, timeout: float = 30.0) -> list[str]:
    """rmdir the cgroup tree `name` in every hierarchy; processes still in it are killed first."""
    deadline = time.monotonic() + timeout
    while True:
        pids = set()
        for d in cgroup_dirs(name):
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 9)
        left = []
        for d in cgroup_dirs(name):
            try:
                d.rmdir()
            except OSError:
                left.append(d)
        if not left:
            return []
        if time.monotonic() > deadline:
            return [f"cgroup not removable: {d}" for d in left]
        time.sleep(0.5)


def remove_empty_trees(dirs: list[Path]) -> list[str]:
    """Remove each of `dirs` (made by the node: /run/containerd, /var/log/containers) if it holds only empty folders."""
    problems = []
    for top in dirs:
        if not top.is_dir():
            continue
        for d, _, files in sorted(os.walk(top), key=lambda w: len(Path(w[0]).parts), reverse=True):
            if files:
                problems.append(f"{d} is not empty: {', '.join(files[:5])}")
                break
            with contextlib.suppress(OSError):
                Path(d).rmdir()
    return problems


def remove_container_log_links(target_root: Path) -> None:
    """The kubelet links /var/log/containers/*.log to the pod logs; remove the links into target_root."""
    links = Path("/var/log/containers")
    if not links.is_dir():
        return
    for link in links.iterdir():
        with contextlib.suppress(OSError):
            if link.is_symlink() and os.readlink(link).startswith(str(target_root)):
                link.unlink()


def _run_out(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else ""
