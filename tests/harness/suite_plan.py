"""How the suite runs in parallel (`make test`: pytest-xdist, `--dist loadgroup`), as pure functions
the root conftest calls. Tiers are the folders under tests/.

- Groups: every test of one module runs on one worker (a module-scoped cluster starts once); the
  k8s tier is one group (one control plane per run) and the node tier another (one kubelet node per
  machine: its bridge, node name and iptables chains are the machine's).
- Order: the groups that mostly wait (the node tier, then the k8s tier: they wait for the background
  builds of the image and of Kubernetes, then for pods and API servers) go to workers first; then the
  multi-process tiers; the unit tests last fill the gaps. Serial runs keep pytest's order.
- Ports: each worker hands out ports from its own slice of pdserve.net's window (PDSERVE_PORTS,
  inherited by the servers it starts), so two workers never race for one port.
"""

from __future__ import annotations

TIERS = ("unit", "e2e", "k8s", "k8s_node", "prometheus", "vllm")
# Tiers whose tests share one group (one cluster each); the others are grouped by module.
WHOLE_TIER_GROUPS = {"k8s": "tier-k8s", "k8s_node": "tier-k8s_node"}
# Worker order: lower first. The node tier first: it waits longest (image and Kubernetes builds).
TIER_ORDER = {"k8s_node": 0, "k8s": 1, "prometheus": 2, "e2e": 3, "vllm": 3, "unit": 4}


def tier_of(nodeid: str) -> str:
    """'tests/e2e/test_x.py::test_y' -> 'e2e' (the folder under tests/), '' when not in a tier."""
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) >= 3 and parts[0] == "tests" and parts[1] in TIERS:
        return parts[1]
    return ""


def group_of(nodeid: str) -> str:
    """The xdist group: the whole tier for k8s and k8s_node, else the module."""
    tier = tier_of(nodeid)
    return WHOLE_TIER_GROUPS.get(tier) or nodeid.split("::", 1)[0]


def order_key(nodeid: str) -> int:
    return TIER_ORDER.get(tier_of(nodeid), 3)


def port_slice(window: tuple[int, int], worker: int, workers: int) -> tuple[int, int]:
    """Worker `worker`'s (0-based) share of `window`, disjoint from the others'."""
    low, high = window
    size = (high - low + 1) // workers
    if size < 100:
        raise ValueError(f"{workers} workers leave fewer than 100 ports each in {low}-{high}")
    start = low + worker * size
    return start, start + size - 1


class TierClock:
    """Per tier: the tests' summed time (setup + call + teardown) and the wall time from the first
    test's start to the last test's end (parallel tiers overlap)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.tests: dict[str, set[str]] = {}

    def add(self, nodeid: str, duration: float, start: float, stop: float) -> None:
        tier = tier_of(nodeid) or "other"
        self.spent[tier] = self.spent.get(tier, 0.0) + duration
        self.tests.setdefault(tier, set()).add(nodeid)
        if start and stop:
            self.first[tier] = min(self.first.get(tier, start), start)
            self.last[tier] = max(self.last.get(tier, stop), stop)

    def lines(self) -> list[str]:
        out = []
        for tier in sorted(self.spent, key=lambda t: -self.spent[t]):
            span = self.last.get(tier, 0.0) - self.first.get(tier, 0.0)
            out.append(f"{tier:<11} {len(self.tests[tier]):>5} tests  {self.spent[tier]:8.1f} s in tests"
                       f"  {span:8.1f} s wall (first start to last end)")
        return out
