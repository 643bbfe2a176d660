"""`make test`'s parallel plan really holds under the pinned pytest and pytest-xdist: a real xdist run
(two workers, --dist loadgroup, the suite's own root conftest) puts every test of a whole-tier group on
one worker, starts the waiting tiers first and gives each worker its own port slice. (pytest 9 with
xdist 3.8 silently ignored groups: each k8s test went to any worker, so several control planes ran.)"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

PROBE = '''
import os

def test_{name}_{i}():
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write("PROBE {tier}/{name}_{i} %s %s\\n" % (os.environ["PYTEST_XDIST_WORKER"], os.environ["PDSERVE_PORTS"]))
'''


def test_a_whole_tier_group_runs_on_one_worker_and_workers_get_disjoint_ports(tmp_path):
    root = tmp_path / "tests"
    (root / "harness").mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", root / "conftest.py")
    for f in ("__init__.py", "suite_plan.py", "procs.py"):
        shutil.copy(TESTS / "harness" / f, root / "harness" / f)
    for tier, name, n in (("k8s", "alpha", 4), ("k8s", "beta", 4), ("unit", "gamma", 6), ("unit", "delta", 6)):
        (root / tier).mkdir(exist_ok=True)
        (root / tier / f"test_{name}.py").write_text("".join(PROBE.format(name=name, i=i, tier=tier) for i in range(n)))
    out = tmp_path / "probes.txt"
    env = {**os.environ, "PYTHONPATH": str(root), "PROBE_OUT": str(out)}
    env.pop("PYTEST_XDIST_WORKER", None), env.pop("PDSERVE_PORTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(root)],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = re.findall(r"PROBE (\w+)/(\w+) (gw\d) (\d+-\d+)", out.read_text())
    assert len(runs) == 20, proc.stdout[-3000:]
    k8s_workers = {w for tier, _, w, _ in runs if tier == "k8s"}
    assert len(k8s_workers) == 1, runs          # one group: one control plane per run
    slices = {w: tuple(map(int, p.split("-"))) for _, _, w, p in runs}
    assert len(slices) == 2, slices
    (a_low, a_high), (b_low, b_high) = sorted(slices.values())
    assert a_high < b_low, slices               # disjoint
    assert "time per tier" in proc.stdout and re.search(r"k8s\s+8 tests", proc.stdout), proc.stdout[-2000:]
