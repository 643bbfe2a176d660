"""--tbt-slo-ms and --step-trace on a real P/D pair (a prefill and a decode process, KV over tcp).

A decode started with a TBT bound no step can meet (1 microsecond) keeps its batch to one request: of
three requests sent together it allocates one and refuses the others for now (code ``tbt_bound``, busy
now), which wait in the prefill's line, before their prompts are computed, and are allocated one after
the other as the one running finishes; every one completes with all its tokens, and afterwards neither
server holds anything. The decode's step trace (GET /debug/steps, and the file written when it stops)
shows it: no step with more than one decode row. (Requests whose KV is already in and that wait in the
engine for room, the bound's other half, are engine unit tests: tests/unit/test_step_budget.py.)

Nothing here depends on the CPU's speed: the first request is held before it joins the batch (the decode
test gate, harness/decode_gate.py) until the other two wait in the prefill's line, so all three overlap;
and a step of the tiny model takes far more than a microsecond on any CPU.
"""

import json
import threading

import pytest

from harness.conditions import wait_until
from harness.decode_gate import DecodeGate
from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

HANG_GUARD_S = 60.0  # only a hang guard
MAX_TOKENS = 100


def _complete(server, i, out):
    out[i] = post_json(server.url + "/v1/completions", {
        "model": "tiny", "prompt": f"Request {i}: list some colours.", "max_tokens": MAX_TOKENS, "ignore_eos": True,
        "temperature": 0}, timeout=120)


def test_the_bound_keeps_the_batch_within_it_and_every_request_completes(tmp_path):
    gate = DecodeGate(tmp_path / "decode-gate")  # closed
    group = ProcessGroup(log_dir=tmp_path / "logs")
    trace_file = tmp_path / "steps.jsonl"
    try:
        with pytest.MonkeyPatch.context() as mp:  # the decode only
            for name, value in gate.env.items():
                mp.setenv(name, value)
            decode = start_decode(group, "tcp", 256,
                                  extra=["--tbt-slo-ms", "0.001", "--step-trace", str(trace_file)])
        wait_ready(decode)
        prefill = start_prefill(group, [decode.grpc_address], "tcp")
        wait_ready(prefill)
        results: dict = {}
        threads = [threading.Thread(target=_complete, args=(prefill, i, results)) for i in range(3)]
        for t in threads:
            t.start()
        gate.wait_held(1, HANG_GUARD_S)  # one allocated, prefilled, held before it joins the batch
        wait_until(lambda: get_json(prefill.url + "/health")[1]["queued"] == 2, "two requests in the prefill's line",
                   HANG_GUARD_S)
        assert len(gate.held()) == 1  # the others were refused for now, not allocated
        gate.open()
        for t in threads:
            t.join(HANG_GUARD_S)
        for i in range(3):
            status, body = results[i]
            assert status == 200 and body["usage"]["completion_tokens"] == MAX_TOKENS, (i, status, body)
        steps = get_json(decode.url + "/debug/steps")[1]["steps"]
        assert sum(s["rows"] for s in steps) == 3 * (MAX_TOKENS - 1)  # every decode step is in the trace
        assert max(s["rows"] for s in steps) == 1  # never two requests in one step
        assert metric(decode.url, "pdserve_kv_allocation_refusals_total", reason="tbt_bound") >= 2
        readings = wait_all_released([prefill, decode], timeout=HANG_GUARD_S)
        assert nothing_held(readings), readings
    finally:
        gate.open()
        group.close()
    written = [json.loads(line) for line in trace_file.read_text().splitlines()]  # written at the decode's stop
    assert sum(s["rows"] for s in written) == 3 * (MAX_TOKENS - 1)


def test_a_decode_without_the_option_has_no_step_trace(tmp_path):
    group = ProcessGroup(log_dir=tmp_path / "logs")
    try:
        decode = start_decode(group, "tcp", 64)
        wait_ready(decode)
        status, body = get_json(decode.url + "/debug/steps")
        assert status == 404 and "--step-trace" in body["error"]
    finally:
        group.close()
