"""The model-server protocol scraped from real servers (one prefill, one decode, real gRPC): the series
a Gateway API Inference Extension endpoint picker reads move with real requests.

- idle: nothing running or queued, no KV in use; ``vllm:cache_config_info`` names each server's
  block size and block count;
- one long request: running on both, the decode's KV in use;
- a second request while the decode has no room for it: queued on the prefill
  (``vllm:num_requests_waiting``), then served;
- afterwards everything is back to zero, and in every scrape the pdserve_ gauges equal the
  protocol's (one reading feeds both).
"""

import json
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.pd_cluster import nothing_held, start_decode, start_prefill, wait_all_released, wait_ready
from pdserve import defaults
from pdserve.test_hooks import DECODE_STEP_FLOOR_ENV as TEST_STEP_FLOOR_ENV

pytestmark = pytest.mark.slow

DECODE_BLOCKS = 4  # one request of MAX_TOKENS (plus its prompt: 4 blocks) fits on the decode, a second must wait
MAX_TOKENS = 200
# the decode's steps last at least this long (a test hook): the first request runs >= 10 s on any CPU, so the
# second is still queued behind it when the test looks (with 900 unslowed tokens a fast CPU had finished the
# first one before the second arrived: 1 CI failure)
STEP_FLOOR_S = 0.05
HANG_GUARD_S = 120.0


def scrape(url: str) -> dict[str, tuple[float, dict]]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = (s.value, s.labels)
    return out


def protocol(url: str) -> dict[str, float]:
    """The protocol's numbers from one scrape, after checking the pdserve_ gauges agree with them."""
    m = scrape(url)
    view = {"waiting": m["vllm:num_requests_waiting"][0], "running": m["vllm:num_requests_running"][0],
            "kv": m["vllm:kv_cache_usage_perc"][0]}
    assert m["pdserve_requests_waiting"][0] == view["waiting"] and m["pdserve_requests_running"][0] == view["running"]
    assert m["vllm:gpu_cache_usage_perc"][0] == view["kv"]
    used, free = m["pdserve_kv_blocks_used"][0], m["pdserve_kv_blocks_free"][0]
    assert view["kv"] == pytest.approx(used / (used + free))
    return view


def wait_until(pred, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def complete(url: str, results: list) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=HANG_GUARD_S) as resp:
        results.append((resp.status, json.loads(resp.read())["usage"]["completion_tokens"]))


def test_protocol_series_move_with_real_requests(procs):
    with pytest.MonkeyPatch.context() as mp:  # start_decode passes our environment on
        mp.setenv(TEST_STEP_FLOOR_ENV, str(STEP_FLOOR_S))
        decode = start_decode(procs, num_blocks=DECODE_BLOCKS)
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], num_blocks=64)
    wait_ready(prefill)

    for server, blocks in ((prefill, 64), (decode, DECODE_BLOCKS)):
        assert protocol(server.url) == {"waiting": 0, "running": 0, "kv": 0}
        info_value, info = scrape(server.url)["vllm:cache_config_info"]
        assert info_value == 1 and info["block_size"] == str(defaults.BLOCK_SIZE)
        assert info["num_gpu_blocks"] == str(blocks)
        # ready means settled: the start-up heap frozen and full collections timed (pdserve.gc_pauses)
        assert "pdserve_gc_full_collection_seconds_count" in scrape(server.url)

    results: list = []
    first = threading.Thread(target=complete, args=(prefill.url, results))
    first.start()
    wait_until(lambda: protocol(prefill.url)["running"] == 1 and protocol(decode.url)["running"] == 1,
               "the request running on prefill and decode")
    kv = protocol(decode.url)["kv"]
    assert kv == 1.0, kv  # prompt + max_tokens reserved on the decode: every block

    second = threading.Thread(target=complete, args=(prefill.url, results))
    second.start()
    queued = wait_until(lambda: (lambda v: v if v["waiting"] == 1 else None)(protocol(prefill.url)),
                        "the second request queued on the prefill (the decode is full)")
    assert queued["running"] == 1
    first.join(timeout=HANG_GUARD_S)
    second.join(timeout=HANG_GUARD_S)
    assert results == [(200, MAX_TOKENS), (200, MAX_TOKENS)]

    wait_until(lambda: all(protocol(s.url) == {"waiting": 0, "running": 0, "kv": 0} for s in (prefill, decode)),
               "everything back to zero", timeout=10)
    assert nothing_held(wait_all_released([prefill, decode]))
