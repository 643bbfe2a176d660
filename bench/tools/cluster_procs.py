"""The node cluster's processes as operator_scale.py counts them: each by kind (a pod's pdserve subcommand, the
pause process, a containerd shim, a control-plane component), with its RSS, PSS and CPU seconds from /proc."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from harness.kube_node import CGROUP_ROOT_NAME

MIB = 2**20
COMPONENTS = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kube-proxy", "kubelet",
              "containerd", "kube-router")


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _kind(cmdline: str, cgroup: str, work: str) -> str | None:
    """What a process is to this benchmark, or None when it is not the cluster's: a pod's pdserve process by
    its subcommand (sim-prefill, sim-decode, router, operator, ...), the pause process, a containerd shim
    or one of COMPONENTS (their command lines name the cluster's work folder)."""
    tokens = cmdline.split()
    if f"/{CGROUP_ROOT_NAME}/" in cgroup:
        at = next((i for i, t in enumerate(tokens) if Path(t).name == "pdserve"), None)
        if at is None or at + 1 >= len(tokens):
            return "pause" if Path(tokens[0]).name == "pause" else "pod-other"
        sim = "--engine=sim" in tokens or any(a == "--engine" and b == "sim" for a, b in zip(tokens, tokens[1:]))
        return ("sim-" if sim else "") + tokens[at + 1]
    if work not in cmdline:
        return None
    exe = Path(tokens[0]).name
    return "shim" if exe == "containerd-shim-runc-v2" else exe if exe in COMPONENTS else None


def processes(work: Path) -> dict[str, list[dict]]:
    """The cluster's processes by kind: pid, RSS and PSS (bytes), CPU seconds (user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, list[dict]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        cmdline = _read(f"{proc}/cmdline").replace("\0", " ").strip()
        kind = _kind(cmdline, _read(f"{proc}/cgroup"), str(work)) if cmdline else None
        if kind is None:
            continue
        stat = _read(f"{proc}/stat").rsplit(")", 1)[-1].split()
        rss = next((int(line.split()[1]) * 1024 for line in _read(f"{proc}/status").splitlines()
                    if line.startswith("VmRSS:")), 0)
        pss = next((int(line.split()[1]) * 1024 for line in _read(f"{proc}/smaps_rollup").splitlines()
                    if line.startswith("Pss:")), 0)
        cpu = (int(stat[11]) + int(stat[12])) / tick if len(stat) > 12 else 0.0
        out.setdefault(kind, []).append({"pid": int(proc.name), "rss": rss, "pss": pss, "cpu_s": cpu})
    return out


def summary(procs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per kind: count, RSS median and sum, PSS sum (MiB), CPU seconds."""
    return {kind: {"count": len(ps), "rss_median_mib": round(statistics.median(p["rss"] for p in ps) / MIB, 1),
                   "rss_sum_mib": round(sum(p["rss"] for p in ps) / MIB, 1),
                   "pss_sum_mib": round(sum(p["pss"] for p in ps) / MIB, 1),
                   "cpu_s": round(sum(p["cpu_s"] for p in ps), 1)}
            for kind, ps in sorted(procs.items())}


def cpu_spent(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> dict[str, float]:
    """CPU seconds per kind between two looks, counting the processes alive at both and those born since."""
    out = {}
    for kind, ps in after.items():
        earlier = {p["pid"]: p["cpu_s"] for p in before.get(kind, [])}
        out[kind] = round(sum(p["cpu_s"] - earlier.get(p["pid"], 0.0) for p in ps), 1)
    return out


def machine_now() -> dict:
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in _read("/proc/meminfo").splitlines()}
    return {"mem_available_gib": round(meminfo.get("MemAvailable", 0) / 2**30, 2),
            "load_avg": [round(x, 2) for x in os.getloadavg()]}
