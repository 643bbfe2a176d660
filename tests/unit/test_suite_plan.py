"""tests/harness/suite_plan.py: how `make test` splits the suite over pytest-xdist workers (groups,
order, port slices, the per-tier clock)."""

import pytest

from harness import suite_plan


def test_tiers_and_groups():
    assert suite_plan.tier_of("tests/e2e/test_pd_e2e.py::test_x[tcp]") == "e2e"
    assert suite_plan.tier_of("tests/k8s_node/test_node_rollout.py::test_y@tier-k8s_node") == "k8s_node"
    assert suite_plan.tier_of("tests/conftest.py::x") == ""
    # the k8s and node tiers are one group each (one control plane, one node per run) ...
    assert suite_plan.group_of("tests/k8s/test_a.py::t") == suite_plan.group_of("tests/k8s/test_b.py::u") == "tier-k8s"
    assert suite_plan.group_of("tests/k8s_node/test_a.py::t") == "tier-k8s_node"
    # ... the others one group per module (a module-scoped cluster starts once)
    assert suite_plan.group_of("tests/e2e/test_a.py::t[1]") == suite_plan.group_of("tests/e2e/test_a.py::u")
    assert suite_plan.group_of("tests/e2e/test_a.py::t") != suite_plan.group_of("tests/e2e/test_b.py::t")


def test_the_waiting_tiers_go_to_workers_first_and_unit_tests_last():
    ids = ["tests/unit/test_a.py::t", "tests/e2e/test_b.py::t", "tests/k8s/test_c.py::t",
           "tests/k8s_node/test_d.py::t", "tests/prometheus/test_e.py::t", "tests/unit/test_f.py::t"]
    ordered = sorted(ids, key=suite_plan.order_key)
    assert [suite_plan.tier_of(i) for i in ordered] == ["k8s_node", "k8s", "prometheus", "e2e", "unit", "unit"]
    assert ordered[-2:] == ["tests/unit/test_a.py::t", "tests/unit/test_f.py::t"]  # stable within a tier


def test_port_slices_are_disjoint_and_cover_the_window():
    window = (10000, 29999)
    slices = [suite_plan.port_slice(window, i, 6) for i in range(6)]
    assert slices[0][0] == 10000 and all(low <= high for low, high in slices)
    assert all(a[1] < b[0] for a, b in zip(slices, slices[1:]))
    assert slices[-1][1] <= 29999 and 29999 - slices[-1][1] < 6
    with pytest.raises(ValueError, match="fewer than 100 ports"):
        suite_plan.port_slice((10000, 10500), 0, 8)


def test_the_tier_clock_sums_time_and_spans_wall_time():
    clock = suite_plan.TierClock()
    clock.add("tests/unit/test_a.py::t", 1.5, 100.0, 101.5)
    clock.add("tests/unit/test_a.py::t", 0.5, 101.5, 102.0)  # the same test's teardown
    clock.add("tests/unit/test_b.py::u", 2.0, 100.0, 102.0)  # in parallel on another worker
    clock.add("tests/e2e/test_c.py::v", 3.0, 0.0, 0.0)  # no start/stop: counted, no span
    assert clock.spent == {"unit": 4.0, "e2e": 3.0}
    unit, e2e = clock.lines()  # most time first
    assert unit.split()[:2] == ["unit", "2"] and "4.0 s in tests" in unit and "2.0 s wall" in unit
    assert e2e.split()[:2] == ["e2e", "1"]
