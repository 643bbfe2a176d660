"""A gate the test opens on the DECODE side: P/D requests held before they join a decode's batch
until the test says so (the test hook ``PDSERVE_TEST_DECODE_GATE``, decode_server/session.py),
for a test that needs streams in flight for as long as it takes something else to happen (a
scale-down drains the decode, a decode leaves discovery), however fast the CPU decodes.

    gate = DecodeGate(tmp_path / "decode-gate")        # closed
    decode = ... started with gate.env in its environment (``pdserve up`` passes its own on) ...
    ... start streams ...
    gate.wait_held(n)   # n sessions live on the decodes, blocks held, first tokens sent, nothing decoded
    ... drain, leave discovery, ...
    gate.open()         # they decode to their end; later ones pass at once

Same files as ``harness.gates.Gate`` (``held.<request id>`` while held, ``open``); only the
variable differs. A closed gate holds a stream until the prefill's --session-timeout fails it.
"""

from __future__ import annotations

from harness.gates import Gate
from pdserve.test_hooks import DECODE_GATE_ENV


class DecodeGate(Gate):
    @property
    def env(self) -> dict[str, str]:
        """The environment that puts a decode (or ``pdserve up``'s decodes) behind this gate."""
        return {DECODE_GATE_ENV: str(self.directory)}
