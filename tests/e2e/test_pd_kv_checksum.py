"""KV checksums with real prefill and decode processes (``--kv-checksum``).

The prefill runs with the test hook ``PDSERVE_TEST_CORRUPT_KV=1`` (cachestore/checksum.py):
its CacheStore sender flips one byte of one layer of the first request it sends, in flight.
The decode must catch it before the request joins its batch; the client gets the correct
greedy output (the request moves to the other decode) or, with one decode, a clear error,
never wrong tokens. Afterwards nothing is held anywhere and the mismatch was counted.
"""


import pytest

from harness.pd_cluster import (metric, nothing_held, post_json, start_decode, start_prefill, wait_all_released,
                                wait_ready)

pytestmark = pytest.mark.slow

CHECKSUM = ["--kv-checksum"]
CORRUPT_ONE = {"PDSERVE_TEST_CORRUPT_KV": "1"}
PROMPT = [256] + [65 + i % 26 for i in range(149)]  # 150 tokens: 3 blocks
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_corrupted_kv_moves_to_the_other_decode_and_output_is_exact(procs, transport):
    decodes = [start_decode(procs, transfer=transport, extra=CHECKSUM, name=f"decode{i}") for i in range(2)]
    for d in decodes:
        wait_ready(d)
    prefill = start_prefill(procs, [d.grpc_address for d in decodes], transfer=transport, extra=CHECKSUM,
                            env=CORRUPT_ONE)
    wait_ready(prefill)

    status, corrupted = post_json(prefill.url + "/v1/completions", BODY)  # its first attempt is corrupted
    assert status == 200, corrupted
    status, clean = post_json(prefill.url + "/v1/completions", BODY)  # the hook is spent: a clean run
    assert status == 200, clean
    assert corrupted["usage"]["completion_tokens"] == clean["usage"]["completion_tokens"] == 12
    assert corrupted["choices"][0]["text"] == clean["choices"][0]["text"]

    assert sum(metric(d.url, "pdserve_kv_checksum_mismatches_total", role="decode") for d in decodes) == 1
    assert metric(prefill.url, "pdserve_kv_checksum_mismatches_total", role="prefill") == 1
    assert metric(prefill.url, "pdserve_decode_retries_total", reason="kv_checksum_mismatch") == 1
    readings = wait_all_released([prefill, *decodes])
    assert nothing_held(readings), readings


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_corrupted_kv_with_one_decode_is_a_clear_error(procs, transport):
    decode = start_decode(procs, transfer=transport, extra=CHECKSUM)
    wait_ready(decode)
    # --resume-wait 0: a mismatch the decode reports after the first token (nixl) ends the request;
    # with a wait it would resume on this decode once its next load report came (a transient failure)
    prefill = start_prefill(procs, [decode.grpc_address], transfer=transport, extra=CHECKSUM + ["--resume-wait", "0"],
                            env=CORRUPT_ONE)
    wait_ready(prefill)

    status, body = post_json(prefill.url + "/v1/completions", BODY)
    # tcp: the corrupted slice is never acknowledged, so prefill learns it before the first
    # token (503, nothing sent); nixl may learn it from the decode after the first token (502)
    assert status in (502, 503), body
    assert "choices" not in body and "kv_checksum_mismatch" in body["error"]["message"], body
    assert metric(decode.url, "pdserve_kv_checksum_mismatches_total") == 1
    assert metric(prefill.url, "pdserve_kv_checksum_mismatches_total") == 1
    # the decode keeps serving: the next request (not corrupted) goes through
    status, body = post_json(prefill.url + "/v1/completions", BODY)
    assert status == 200 and body["usage"]["completion_tokens"] == 12, body
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings
