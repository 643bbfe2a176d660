"""Network faults between prefill and decode: the run inside a network namespace, and tc.

``--netem`` runs the whole chaos bench (``pdserve up`` and the load client) inside a fresh
network namespace ``pdchaos-<pid>``, so that shaping its loopback touches nothing else:

1. **namespace** (``run_in_namespace``, in the process the user started): ``ip netns add``,
   ``lo`` up in it, then the same command line again under ``ip netns exec`` with
   ``PDSERVE_CHAOS_NETNS=<ns>`` in its environment (the marker that says "inside"). When that
   child ends, however it ends, processes still in the namespace get SIGTERM then SIGKILL
   and the namespace is deleted (which removes every qdisc in it). The root namespace's
   interfaces and qdiscs are never touched: every tc command names the namespace
   (``tc -n <ns> ...``) and ``Shaper`` refuses to work unless this process is inside it.
2. **ports** (``decode_ports``): each decode's gRPC (Session) ``--port`` and CacheStore
   ``--kv-port``, from the argv (/proc/<pid>/cmdline) of the pids in servers.json; ``pdserve
   up`` fixes them at start and a restart reuses them.
3. **shaping** (``Shaper.apply`` / ``clear``): a classful root qdisc on the namespace's
   ``lo``; u32 filters match TCP whose destination *or* source port is one of those ports
   (requests to the decodes and their replies) and steer it into a shaped class; everything
   else (client <-> prefill HTTP, /metrics, /health) is not shaped. ``clear`` deletes the
   root qdisc, which gives lo back its default ``noqueue``.

Two backends, chosen by probing the kernel in the fresh namespace (``probe_backend``):

- ``netem``: ``prio bands 4`` (default priomap, so unmatched traffic keeps bands 1-3) with
  ``netem <spec>`` under band 4 (1:4), the spec as given (``delay 50ms 20ms loss 2%``).
- ``htb`` for kernels built without sch_netem / sch_prio (CONFIG_NET_SCH_NETEM unset, as on
  the Firecracker VMs): ``htb`` root (unclassified traffic goes direct, unshaped), matched
  traffic into class 1:1 (``rate`` of the spec, else 10gbit), under which an inner htb sends
  a random ``loss`` fraction (a classic-BPF classifier on the kernel's random number) to a
  ``pfifo limit 0`` that drops all it gets. ``delay`` cannot be done without netem: it is
  recorded as not applied, never silently claimed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NS_ENV = "PDSERVE_CHAOS_NETNS"
NS_PREFIX = "pdchaos-"
DEV = "lo"
NETNS_DIR = Path("/run/netns")
# prio's default priomap (TOS -> band 0..2); band 3 (class 1:4) is reached only by our filters
PRIOMAP = "1 2 2 2 1 2 0 0 1 1 1 1 1 1 1 1"
HTB_DEFAULT_RATE = "10gbit"
SKF_AD_RANDOM = 0xFFFFF000 + 56  # classic BPF ancillary load: a random u32
LOSS_SCALE = 10000               # loss resolution: 0.01 %


# ---------------------------------------------------------------- pure parts (unit-tested)

def namespace_name(pid: int) -> str:
    return f"{NS_PREFIX}{pid}"


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def decode_ports_from_argv(argv: list[str]) -> tuple[int, int]:
    """(gRPC Session port, CacheStore KV port) of a ``pdserve decode`` command line."""
    if "decode" not in argv:
        raise ValueError(f"not a decode server's command line: {argv}")
    grpc, kv = _flag(argv, "--port"), _flag(argv, "--kv-port")
    if grpc is None or kv is None:
        raise ValueError(f"decode command line without --port and --kv-port: {argv}")
    return int(grpc), int(kv)


def decode_ports(servers: dict, read_argv) -> list[int]:
    """Every decode's gRPC and KV ports (sorted), from servers.json's pids; ``read_argv(pid)``
    gives a pid's argv (``proc_argv`` reads /proc)."""
    ports: set[int] = set()
    for name, s in sorted(servers.items()):
        if name.startswith("decode"):
            if not s.get("pid"):
                raise ValueError(f"{name} has no pid in servers.json")
            ports.update(decode_ports_from_argv(read_argv(s["pid"])))
    if not ports:
        raise ValueError("no decode server in servers.json")
    return sorted(ports)


def proc_argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")


@dataclass(frozen=True, slots=True)
class NetemSpec:
    text: str                 # as given, for netem
    delay: str | None         # "50ms 20ms" (delay and optional jitter)
    loss_pct: float | None
    rate: str | None


_TIME = r"\d+(?:\.\d+)?(?:us|ms|s)"


def parse_spec(text: str) -> NetemSpec:
    """A netem spec restricted to what both backends understand: ``delay T [J]``, ``loss P%``, ``rate R``."""
    tokens, delay, loss, rate, i = text.split(), None, None, None, 0
    if not tokens:
        raise ValueError("empty --netem-spec")
    while i < len(tokens):
        t = tokens[i]
        if t == "delay" and i + 1 < len(tokens) and re.fullmatch(_TIME, tokens[i + 1]):
            n = 3 if i + 2 < len(tokens) and re.fullmatch(_TIME, tokens[i + 2]) else 2
            delay, i = " ".join(tokens[i + 1:i + n]), i + n
        elif t == "loss" and i + 1 < len(tokens) and re.fullmatch(r"\d+(?:\.\d+)?%", tokens[i + 1]):
            loss, i = float(tokens[i + 1][:-1]), i + 2
            if not 0 <= loss <= 100:
                raise ValueError(f"loss must be 0..100%, got {loss}%")
        elif t == "rate" and i + 1 < len(tokens) and re.fullmatch(r"\d+(?:\.\d+)?(?:k|m|g)?bit", tokens[i + 1]):
            rate, i = tokens[i + 1], i + 2
        else:
            raise ValueError(f"--netem-spec: cannot read {' '.join(tokens[i:])!r} "
                             "(use: delay 50ms [20ms], loss 2%, rate 100mbit)")
    return NetemSpec(" ".join(tokens), delay, loss, rate)


def _tc(ns: str, *args: str) -> list[str]:
    return ["tc", "-n", ns, *args]


def _port_filters(ns: str, ports: list[int], flowid: str) -> list[list[str]]:
    out = []
    for port in ports:
        for direction in ("dport", "sport"):  # requests to the decode, and its replies
            out.append(_tc(ns, "filter", "add", "dev", DEV, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                           "match", "ip", "protocol", "6", "0xff", "match", "ip", direction, str(port), "0xffff",
                           "flowid", flowid))
    return out


def netem_commands(ns: str, ports: list[int], spec: NetemSpec) -> list[list[str]]:
    """prio root, netem under band 4, u32 filters of the ports into band 4."""
    if not ports:
        raise ValueError("no ports to shape")
    return [_tc(ns, "qdisc", "add", "dev", DEV, "root", "handle", "1:", "prio", "bands", "4", "priomap",
                *PRIOMAP.split()),
            _tc(ns, "qdisc", "add", "dev", DEV, "parent", "1:4", "handle", "40:", "netem", *spec.text.split()),
            *_port_filters(ns, ports, "1:4")]


def loss_bytecode(loss_pct: float) -> str:
    """Classic BPF for tc's ``bpf bytecode``: match (return -1: the filter's classid) a random
    ``loss_pct`` % of packets, let the rest through (return 0: no match)."""
    threshold = round(loss_pct / 100 * LOSS_SCALE)
    prog = [(0x20, 0, 0, SKF_AD_RANDOM),   # ld [random]
            (0x94, 0, 0, LOSS_SCALE),      # A %= LOSS_SCALE
            (0x35, 1, 0, threshold),       # if A >= threshold: skip to "return 0"
            (0x06, 0, 0, 0xFFFFFFFF),      # return -1: drop class
            (0x06, 0, 0, 0)]               # return 0: not matched
    return ",".join([str(len(prog))] + [f"{c} {jt} {jf} {k}" for c, jt, jf, k in prog])


def htb_commands(ns: str, ports: list[int], spec: NetemSpec) -> list[list[str]]:
    """For kernels without netem: htb root, matched ports into 1:1 (rate), random loss to a dropping pfifo."""
    if not ports:
        raise ValueError("no ports to shape")
    rate = spec.rate or HTB_DEFAULT_RATE
    cmds = [_tc(ns, "qdisc", "add", "dev", DEV, "root", "handle", "1:", "htb", "default", "0", "r2q", "100000"),
            _tc(ns, "class", "add", "dev", DEV, "parent", "1:", "classid", "1:1", "htb", "rate", rate)]
    if spec.loss_pct:
        cmds += [_tc(ns, "qdisc", "add", "dev", DEV, "parent", "1:1", "handle", "10:", "htb", "default", "0", "r2q",
                     "100000"),
                 _tc(ns, "class", "add", "dev", DEV, "parent", "10:", "classid", "10:2", "htb", "rate", rate),
                 _tc(ns, "qdisc", "add", "dev", DEV, "parent", "10:2", "handle", "20:", "pfifo", "limit", "0"),
                 _tc(ns, "filter", "add", "dev", DEV, "parent", "10:", "protocol", "ip", "prio", "1", "bpf",
                     "bytecode", loss_bytecode(spec.loss_pct), "classid", "10:2")]
    return cmds + _port_filters(ns, ports, "1:1")


def htb_applied(spec: NetemSpec) -> tuple[str, str]:
    """(what the htb backend applies, what it cannot) of a spec, in netem words."""
    done = [f"loss {spec.loss_pct:g}%" if spec.loss_pct else "", f"rate {spec.rate}" if spec.rate else ""]
    return " ".join(d for d in done if d), (f"delay {spec.delay}" if spec.delay else "")


def parse_qdisc_stats(text: str) -> dict[str, dict[str, int]]:
    """``tc -s qdisc show`` -> {handle: {"sent_pkts", "dropped"}} of the qdiscs under the root
    (what the shaped class passed and dropped)."""
    out, handle = {}, None
    for line in text.splitlines():
        m = re.match(r"qdisc \S+ (\S+) (root|parent)", line)
        if m:
            handle = m.group(1) if m.group(2) == "parent" else None
            continue
        m = re.match(r"\s*Sent \d+ bytes (\d+) pkt \(dropped (\d+)", line)
        if m and handle:
            out[handle] = {"sent_pkts": int(m.group(1)), "dropped": int(m.group(2))}
    return out


def clear_command(ns: str) -> list[str]:
    return _tc(ns, "qdisc", "del", "dev", DEV, "root")


# ---------------------------------------------------------------- the namespace (root only)

def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.strip()]


def namespace_pids(ns: str) -> list[int]:
    return [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _remove_stale() -> None:
    """pdchaos-<pid> namespaces of runs that were killed before cleaning up: their pid is gone and nothing is inside."""
    for ns in namespaces():
        m = re.fullmatch(re.escape(NS_PREFIX) + r"(\d+)", ns)
        if m and not _alive(int(m.group(1))) and not namespace_pids(ns):
            _run(["ip", "netns", "del", ns], check=False)


def _empty_namespace(ns: str, grace: float = 30.0) -> None:
    """SIGTERM (then SIGKILL after ``grace``) to every process left in our namespace: all were started by this run."""
    pids = namespace_pids(ns)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = namespace_pids(ns)
        if not pids:
            return


def run_in_namespace(argv: list[str]) -> int:
    """Create ``pdchaos-<pid>``, run ``python -m pdserve <argv>`` inside it, delete it whatever happens."""
    if os.geteuid() != 0:
        raise RuntimeError("--netem needs root (network namespaces and tc need CAP_NET_ADMIN)")
    ns = namespace_name(os.getpid())
    _remove_stale()
    proc = None
    old_int, old_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the child turns it into KeyboardInterrupt and cleans up

    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", DEV, "up"])
        print(f"network namespace {ns} created; running the chaos bench inside it", flush=True)
        # Ctrl-C reaches the child directly (same process group); this process waits for it to clean up
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, on_term)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "pdserve", *argv],
                                env={**os.environ, NS_ENV: ns})
        return proc.wait()
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(180)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if ns in namespaces():
            _empty_namespace(ns)
            _run(["ip", "netns", "del", ns], check=False)
            print(f"network namespace {ns} deleted", flush=True)
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def inside_namespace() -> str | None:
    """The namespace this process was re-executed in (marker set and really inside it), else None."""
    ns = os.environ.get(NS_ENV)
    if not ns:
        return None
    try:
        if os.stat("/proc/self/ns/net").st_ino != os.stat(NETNS_DIR / ns).st_ino:
            raise RuntimeError(f"{NS_ENV}={ns} but this process is not in that network namespace")
    except FileNotFoundError:
        raise RuntimeError(f"{NS_ENV}={ns} but there is no such network namespace") from None
    return ns


def probe_backend(ns: str) -> str:
    """'netem' if this kernel has sch_prio and sch_netem (tried on our namespace's lo, then removed), else 'htb'."""
    probe = [_tc(ns, "qdisc", "add", "dev", DEV, "root", "handle", "1:", "prio", "bands", "4", "priomap",
                 *PRIOMAP.split()),
             _tc(ns, "qdisc", "add", "dev", DEV, "parent", "1:4", "handle", "40:", "netem", "delay", "1ms")]
    try:
        return "netem" if all(_run(cmd, check=False).returncode == 0 for cmd in probe) else "htb"
    finally:
        _run(clear_command(ns), check=False)


class Shaper:
    """Applies and clears the shaping of the decodes' ports on our namespace's lo."""

    def __init__(self, ns: str, ports: list[int], spec: NetemSpec, backend: str | None = None):
        if inside_namespace() != ns:
            raise RuntimeError(f"refusing to shape: this process is not inside {ns}")
        self.ns, self.ports, self.spec = ns, ports, spec
        self.backend = backend or probe_backend(ns)
        if self.backend == "netem":
            self.applied, self.not_applied = spec.text, ""
        else:
            self.applied, self.not_applied = htb_applied(spec)
        self.active = False

    def describe(self) -> str:
        s = f"tc {self.backend} on {self.ns}/lo, ports {self.ports}: {self.applied or 'nothing'}"
        return s + (f" (not applied, no sch_netem in this kernel: {self.not_applied})" if self.not_applied else "")

    def apply(self) -> None:
        cmds = netem_commands(self.ns, self.ports, self.spec) if self.backend == "netem" else \
            htb_commands(self.ns, self.ports, self.spec)
        self.active = True
        try:
            for cmd in cmds:
                _run(cmd)
        except BaseException:
            self.clear()
            raise

    def clear(self) -> dict[str, dict[str, int]] | None:
        """Remove the shaping; returns what its qdiscs passed and dropped meanwhile."""
        if not self.active:
            return None
        stats = parse_qdisc_stats(_run(_tc(self.ns, "-s", "qdisc", "show", "dev", DEV), check=False).stdout)
        _run(clear_command(self.ns), check=False)  # back to lo's default noqueue
        self.active = False
        return stats
