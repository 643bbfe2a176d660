"""A gate the test opens on ``pdserve up --autoscale``'s PLANNER: it neither observes nor decides
until the test says so (the test hook ``PDSERVE_TEST_PLANNER_GATE``, localcluster/up.py), so a
test can place its streams first, however slow the box, and only then let the planner watch its
window and act on what it sees.

    planner = PlannerGate(tmp_path / "planner-gate")   # closed
    up = ... `pdserve up --autoscale` started with planner.env in its environment ...
    ... start streams, wait until they are where the test needs them ...
    planner.open()      # its first window starts now

Nothing is ever held at this gate (``held()`` stays empty); only ``open`` matters.
"""

from __future__ import annotations

from harness.gates import Gate
from pdserve.test_hooks import PLANNER_GATE_ENV


class PlannerGate(Gate):
    @property
    def env(self) -> dict[str, str]:
        """The environment that puts ``pdserve up``'s planner behind this gate."""
        return {PLANNER_GATE_ENV: str(self.directory)}
