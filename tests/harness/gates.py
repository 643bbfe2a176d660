"""A gate the test opens: prefill requests held after their decode's Allocation until the test
says so (the test hook ``PDSERVE_TEST_GATE_AFTER_ALLOCATION``, prefill_server/decode_session.py).

    gate = Gate(tmp_path / "gate")                     # closed
    prefill = start_prefill(procs, [...], env=gate.env)
    ... send a request ...
    gate.wait_held(1)   # it is admitted, the decode holds its blocks, no KV has moved yet
    ... freeze, kill, flood, queue more behind it ...
    gate.open()         # the held requests go on; later ones pass at once
    gate.close()        # later ones are held again

A held request announces itself with a file ``held.<request id>`` in the gate's directory and
removes it when it goes on (the gate opened, or it was cancelled), so ``held()`` is what is held
now. A closed gate holds a request for ever: the decode drops it after its --session-timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

from pdserve.test_hooks import PREFILL_GATE_ENV

HANG_GUARD_S = 60.0  # only a hang guard: a request reaches the gate in well under a second
POLL_S = 0.02


class Gate:
    def __init__(self, directory: Path | str, opened: bool = False):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if opened:
            self.open()
        else:
            self.close()

    @property
    def env(self) -> dict[str, str]:
        """The environment that puts a prefill behind this gate (``start_prefill(..., env=gate.env)``)."""
        return {PREFILL_GATE_ENV: str(self.directory)}

    def open(self) -> None:
        (self.directory / "open").touch()

    def close(self) -> None:
        (self.directory / "open").unlink(missing_ok=True)

    def held(self) -> list[str]:
        """The request ids held at the gate now (sorted)."""
        return sorted(p.name[len("held."):] for p in self.directory.glob("held.*"))

    def wait_held(self, n: int, timeout: float = HANG_GUARD_S) -> list[str]:
        """Wait until at least ``n`` requests are held at the gate; return their ids."""
        deadline = time.monotonic() + timeout
        while len(held := self.held()) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"hang guard: {len(held)} of {n} requests held at the gate after {timeout}s")
            time.sleep(POLL_S)
        return held
