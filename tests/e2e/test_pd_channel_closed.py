"""A Session whose gRPC channel is closed under it resumes on another decode (real processes).

A decode that leaves discovery keeps its open Sessions for ``--decode-leave-grace`` seconds;
then the prefill closes its channel, which cancels the calls still open on it. gRPC's asyncio
API raises ``CancelledError`` from those calls' reads although nobody cancelled the request;
the prefill must treat that as the decode failing mid-generation (DecodeFailed), so the
request resumes on another decode, and not as the client going away (a cut stream).
"""

import http.client
import json
import os
import re

import pytest

from harness.pd_cluster import (get_json, metric, nothing_held, start_decode, start_prefill, wait_all_released,
                                wait_ready)
from pdserve.test_hooks import DECODE_STEP_FLOOR_ENV as TEST_STEP_FLOOR_ENV

pytestmark = pytest.mark.slow

MAX_TOKENS = 1500
GRACE_S = 1.0
# the leaving decode's steps last at least this long (a test hook): its part of the stream lasts >= 30 s on
# any CPU, so it is still generating when the grace ends (with no floor, a fast CPU finished all 1500 tokens
# before the prefill closed the channel: nothing resumed, 1 CI failure); the staying decode has no floor
LEAVING_STEP_FLOOR_S = 0.02


def stream_completion(port: int, prompt: str, max_tokens: int, on_first) -> dict:
    """Stream a completion (ignore_eos, usage included); call ``on_first`` after the first event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:])
            if len(events) == 1:
                on_first()
    return {"events": events}


def test_a_session_whose_channel_closes_under_it_resumes_on_another_decode(procs, tmp_path):
    with pytest.MonkeyPatch.context() as mp:  # start_decode passes our environment on
        mp.setenv(TEST_STEP_FLOOR_ENV, str(LEAVING_STEP_FLOOR_S))
        leaving = start_decode(procs, num_blocks=256, name="leaving")
    staying = start_decode(procs, num_blocks=256, name="staying")
    decodes_file = tmp_path / "decodes.txt"
    decodes_file.write_text(f"{leaving.grpc_address}\n")              # the stream starts on `leaving`
    prefill = start_prefill(procs, [], extra=["--discovery", "file", "--decode-file", str(decodes_file),
                                              "--decode-leave-grace", str(GRACE_S)])
    for server in (leaving, staying, prefill):
        wait_ready(server)

    def swap_decodes() -> None:                                         # `leaving` leaves, `staying` joins
        tmp = tmp_path / "decodes.tmp"
        tmp.write_text(f"{staying.grpc_address}\n")
        os.replace(tmp, decodes_file)

    out = stream_completion(prefill.http_port, "the channel closes under this stream", MAX_TOKENS, swap_decodes)
    events = out["events"]
    assert not any(e.startswith('{"error"') for e in events), events[-3:]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finishes[-1] == "length", finishes[-3:]
    usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    assert usage["completion_tokens"] == MAX_TOKENS, usage

    # it really moved: the closed channel was the reason, and the staying decode took the rest
    log = (tmp_path / "logs" / "prefill.log").read_text(errors="replace")
    resumed = re.search(r"the session's channel was closed mid-generation.*resuming after (\d+) tokens", log)
    assert resumed, log[-3000:]
    assert 0 < int(resumed.group(1)) < MAX_TOKENS
    assert metric(prefill.url, "pdserve_decode_retries_total", reason="decode_channel_closed") == 1
    assert metric(prefill.url, "pdserve_decode_selections_total", decode=staying.grpc_address) == 1
    assert metric(prefill.url, "pdserve_requests_total", outcome="error") == 0
    assert get_json(prefill.url + "/health")[1]["decodes"] == [staying.grpc_address]
    # the cancelled Session was freed on the decode it left, and nothing is held anywhere
    assert nothing_held(wait_all_released([prefill, leaving, staying], timeout=30))
