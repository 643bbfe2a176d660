"""What every section of the GPU check shares: the log, budgets, timing, memory, the section record.

- ``log(section, msg)``: one line, wall clock and seconds since the run started (the log is all
  that comes back from a killed run, so every step says what it does before doing it).
- ``Budget``: seconds a section may spend, capped by the run's deadline; a section asks
  ``budget.left()`` before each cell and skips the rest (``Record.skip``) once it is spent.
- ``time_ms(fn, device)``: one call's time in ms. CUDA: two ``torch.cuda.Event(enable_timing=True)``
  around the call on the current stream, then the end event's synchronize; CPU: ``perf_counter``
  around the call. ``time_median`` runs warm-ups first and takes the median of the timed calls.
- ``Record``: a section's result (status, notes, figures, error), written to
  ``OUT/sections/NAME.json`` (atomically) after each cell, so a killed run keeps what was done.
- ``guarded(rec, label, row, device)``: one cell's exception is printed with its traceback, recorded
  in the cell's row (``row["error"]``) and the section's ``cell_errors``, and the section goes on
  with its next cell; an exception that ``fatal_cuda`` names is raised on.
- ``fatal_cuda(exc)``: whether an exception leaves the CUDA context unusable (illegal address,
  device-side assert, launch failure): the worker then exits and a fresh one runs the next section.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

START = time.time()  # the run's start (the worker gets the parent's through CHECK_START)
if os.environ.get("CHECK_START"):
    START = float(os.environ["CHECK_START"])

GIB = 1 << 30
FATAL_CUDA = ("illegal memory access", "device-side assert", "unspecified launch failure", "CUDA error: an illegal",
              "cudaErrorLaunchFailure", "CUBLAS_STATUS_EXECUTION_FAILED", "misaligned address",
              "uncorrectable ECC", "CUDA error: unknown error")


def log(section: str, msg: str) -> None:
    now = time.time()
    print(f"[{time.strftime('%H:%M:%S', time.localtime(now))} +{now - START:6.1f}s] {section}: {msg}", flush=True)


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON through a temporary file and a rename (a reader never sees half a file)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Budget:
    """``seconds`` from now, never past ``deadline`` (an epoch time, or None)."""

    def __init__(self, seconds: float, deadline: float | None = None):
        self.start = time.time()
        self.end = self.start + seconds
        if deadline is not None:
            self.end = min(self.end, deadline)

    def left(self) -> float:
        return self.end - time.time()

    def spent(self) -> float:
        return time.time() - self.start


class Record:
    """One section's result; ``save()`` writes it to ``OUT/sections/NAME.json``."""

    def __init__(self, out: Path, name: str):
        self.path = out / "sections" / f"{name}.json"
        self.data: dict[str, Any] = {"name": name, "status": "running", "started": time.time(), "notes": [],
                                     "skipped": [], "results": {}}

    @property
    def results(self) -> dict[str, Any]:
        return self.data["results"]

    def note(self, msg: str) -> None:
        self.data["notes"].append(msg)
        log(self.data["name"], msg)

    def skip(self, what: str, why: str) -> None:
        """A cell not run: recorded with the reason (the section ends as "partial")."""
        self.data["skipped"].append(f"{what}: {why}")
        log(self.data["name"], f"skipped {what}: {why}")

    def save(self) -> None:
        self.data["seconds"] = round(time.time() - self.data["started"], 2)
        write_json(self.path, self.data)


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device) -> float:
    """Milliseconds one call of ``fn`` takes on ``device`` (see the module)."""
    import torch

    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_median(fn: Callable[[], Any], device, reps: int, warmup: int) -> tuple[float, list[float]]:
    """(median ms, every timed ms) of ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = [time_ms(fn, device) for _ in range(reps)]
    return statistics.median(samples), [round(s, 4) for s in samples]


def release(device) -> None:
    """Drop unreferenced tensors and hand cached CUDA blocks back (so free memory is what it is)."""
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def free_bytes(device) -> int:
    """Bytes free on the device now (CUDA: ``mem_get_info``; CPU: MemAvailable)."""
    import torch

    release(device)
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@contextmanager
def guarded(rec: Record, label: str, row: dict, device):
    try:
        yield
    except Exception as exc:
        if fatal_cuda(exc):
            raise
        print(traceback.format_exc(), flush=True)
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rec.data.setdefault("cell_errors", []).append(f"{label}: {row['error']}")
        rec.note(f"{label}: ERROR {row['error']}")
        rec.save()
        release(device)


def fatal_cuda(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in FATAL_CUDA)


def gib(n: float) -> float:
    return round(n / GIB, 2)


def sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (a CPU smoke run's 0.004 TFLOP/s is not 0.0)."""
    return float(f"{x:.{digits}g}")
