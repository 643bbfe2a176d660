"""Peak resident memory and CPU time of this process during one measurement (Linux /proc).

``PeakRSS.start()`` resets the kernel's peak (VmHWM, via /proc/self/clear_refs) and notes
the current RSS; ``stop()`` returns how far the peak rose above it. Where the reset is not
permitted, a 1 ms sampling thread measures the peak instead. ``cpu_s`` after ``stop()`` is
the process CPU time (all threads) spent in between: unlike wall time, it hardly moves when
other programs load the machine.
"""

from __future__ import annotations

import threading
import time


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRSS:
    def __init__(self) -> None:
        self._base = 0
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm_reset = False
        self._cpu0 = 0.0
        self.cpu_s = 0.0

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._hwm_reset = True
        except OSError:
            self._hwm_reset = False
        self._base = _status_kib("VmRSS")
        self._sampled = self._base
        self._cpu0 = time.process_time()
        if not self._hwm_reset:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled = max(self._sampled, _status_kib("VmRSS"))
            time.sleep(0.001)

    def stop(self) -> int:
        """Bytes the peak RSS rose above the RSS at start() (and sets cpu_s)."""
        self.cpu_s = time.process_time() - self._cpu0
        if self._hwm_reset:
            peak = _status_kib("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
            peak = self._sampled
        return max(0, peak - self._base) * 1024
