"""What else ran on the machine at the end of a run (the box is shared): load average, busiest processes."""

from __future__ import annotations

import os
import subprocess


def load_note() -> dict:
    try:
        top = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()[1:9]
    except (OSError, subprocess.TimeoutExpired):
        top = []
    return {"load_avg_end": list(os.getloadavg()), "busiest": [line.strip() for line in top]}
