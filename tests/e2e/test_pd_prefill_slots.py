"""A request queued behind a busy prefill holds nothing on a decode (``--prefills-ahead``).

Sixteen long prompts arrive at once at one prefill whose Sessions tell the decode to wait at
most 2 s for KV (``--session-timeout 2``). Together they take several seconds of prefill
compute. Before prefill slots, every request took its decode allocation at once and waited
for the prefill's engine there, so the decode dropped most of them ("KV did not all arrive
within the expect timeout") and the client got 503 (on this machine: 24 of 24). With
``--prefills-ahead 2`` the others wait on the prefill, holding nothing on the decode: every
request succeeds, and afterwards nothing is held on either side.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.pd_cluster import nothing_held, post_json, start_decode, start_prefill, wait_all_released, wait_ready
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow


def test_requests_queued_behind_the_prefill_do_not_time_out_on_the_decode(tmp_path):
    with ProcessGroup(log_dir=tmp_path / "logs") as group:
        decode = start_decode(group, "tcp", 2048)
        wait_ready(decode)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", num_blocks=2048,
                                extra=["--session-timeout", "2", "--prefills-ahead", "2"])
        wait_ready(prefill)

        def one(i: int):
            body = {"model": "tiny", "prompt": [(i * 7 + j) % 200 + 1 for j in range(2000)], "max_tokens": 4}
            return post_json(prefill.url + "/v1/completions", body, timeout=120)

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(16)))
        assert [status for status, _ in answers] == [200] * 16, [out for status, out in answers if status != 200][:2]
        readings = wait_all_released([prefill, decode])
        assert nothing_held(readings), readings
