"""A request queued behind a busy prefill holds nothing on a decode (the engine's line, ``want``/``grant``).

Sixteen long prompts arrive at once at one prefill whose Sessions tell the decode to wait at
most T for KV (``--session-timeout``), T = 8 prefills of one such prompt, as measured first on a
probe prefill on this box at this moment (at least 2 s): the timeout is a multiple of the work,
not a wall-clock guess, so a slow or busy box scales both. Together the sixteen take 16 prefills of
compute. If every request took its decode allocation at once and waited for the prefill's engine
there, the decode would drop the later half of them ("KV did not all arrive within the expect
timeout") and the client would get 503 (with a 2 s timeout: 24 of 24). Instead each waits in the
prefill engine's Scheduler, holding nothing on the decode, until the Scheduler wants it (its step,
or the step before: at most one step's budget of prompt tokens, here about one 2000-token prompt,
ahead), so an allocated request waits for at most about 2 prefills: every request succeeds, and
afterwards nothing is held on either side.
"""

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.pd_cluster import nothing_held, post_json, start_decode, start_prefill, wait_all_released, wait_ready
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 2000


def body(i: int) -> dict:
    return {"model": "tiny", "prompt": [(i * 7 + j) % 200 + 1 for j in range(PROMPT_TOKENS)], "max_tokens": 4}


def one_prefill_s(group: ProcessGroup, decode) -> float:
    """Seconds of one request of PROMPT_TOKENS new tokens on a probe prefill (the second of two: the first
    warms up); the probe is stopped before it returns."""
    probe = start_prefill(group, [decode.grpc_address], "tcp", num_blocks=2048, name="probe")
    wait_ready(probe)
    took = []
    for i in (20, 21):  # prompts of their own (offsets 140, 147): no prefix shared with the sixteen below
        t0 = time.monotonic()
        status, out = post_json(probe.url + "/v1/completions", body(i), timeout=120)
        took.append(time.monotonic() - t0)
        assert status == 200, out
    group.kill(probe.proc, signal.SIGTERM)
    return took[-1]


def test_requests_queued_behind_the_prefill_do_not_time_out_on_the_decode(tmp_path):
    with ProcessGroup(log_dir=tmp_path / "logs") as group:
        decode = start_decode(group, "tcp", 2048)
        wait_ready(decode)
        timeout_s = max(2.0, 8 * one_prefill_s(group, decode))
        prefill = start_prefill(group, [decode.grpc_address], "tcp", num_blocks=2048,
                                extra=["--session-timeout", f"{timeout_s:.1f}"])
        wait_ready(prefill)

        def one(i: int):
            return post_json(prefill.url + "/v1/completions", body(i), timeout=120)

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(16)))
        failed = [out for status, out in answers if status != 200][:2]
        assert [status for status, _ in answers] == [200] * 16, (f"session timeout {timeout_s:.1f} s", failed)
        readings = wait_all_released([prefill, decode])
        assert nothing_held(readings), readings
