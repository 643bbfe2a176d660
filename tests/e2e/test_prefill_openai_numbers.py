"""Numbers validated at the edge, through real processes (one decode, one prefill, tcp):
raw JSON bodies with huge integers, 1e308, NaN / Infinity literals, booleans, strings and
lists in numeric fields of /v1/completions and /v1/chat/completions (and odd numbers in gRPC
Generate) get 400 / INVALID_ARGUMENT naming the field, never a 500; the prefill logs no
traceback, keeps serving, and afterwards nothing is held on either process.

Before: seed 10**30 or 2**63, top_k 10**30 or 3e9 and stop_token_ids [3e9] passed the parser
and failed building the Session's Sampling message (int32/int64 fields) -> HTTP 500."""

import json

import grpc
import pytest

from harness.pd_cluster import nothing_held, post_json, start_decode, start_prefill, wait_all_released, wait_ready
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

HUGE = "1" + "0" * 30  # 10**30 as a JSON literal
# (field, raw JSON value): every one a 400 naming the field, on both endpoints unless noted
BAD = [
    *[("max_tokens", v) for v in ("1e308", HUGE, "NaN", "Infinity", "-Infinity", "true", '"16"', "[16]", "0", "-1",
                                  "2.5")],
    *[("temperature", v) for v in ("1e30", "1e308", "NaN", "Infinity", "-Infinity", "true", '"0.5"', "-0.5", "1e-300")],
    *[("top_p", v) for v in ("NaN", "1e308", "Infinity", "0", "-1", "1.5", "false", "1e-320")],
    *[("top_k", v) for v in (HUGE, "3000000000", "-2", "true", "NaN", '"5"', "0.5")],
    *[("seed", v) for v in (HUGE, "9223372036854775808", "-1", "true", "NaN", "1.5", '"7"', "{}")],
    *[("n", v) for v in (HUGE, "true", "17", "NaN")],
    *[("best_of", v) for v in ("2", "true", HUGE)],
    *[("logprobs", v) for v in (HUGE, "Infinity", "21")],
    *[("top_logprobs", v) for v in ("1e308", "21", "true")],
    *[("presence_penalty", v) for v in ("1e308", "NaN", "2.5")],
    *[("frequency_penalty", v) for v in ("-Infinity", '"x"', "-3")],
    *[("stop_token_ids", v) for v in ("[1" + "0" * 21 + "]", "[3000000000]", "[-1]", "[NaN]", "[true]", "[300]",
                                      "[1.5]", "5")],
]
CHAT_ONLY = [("max_completion_tokens", v) for v in ("1e308", "NaN", HUGE, "true")]
COMPLETION_ONLY = [("logprobs", "true")]  # an integer there; chat's logprobs is the boolean
PROMPT_IDS = ["[1, " + HUGE + "]", "[1, -1]", "[1, 300]", "[1, 1.5]", "[1, true]", "[1, null]", "[1, NaN]",
              "[2147483648]"]

ENDPOINTS = {
    "/v1/completions": '"prompt": "numbers"',
    "/v1/chat/completions": '"messages": [{"role": "user", "content": "numbers"}]',
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("numbers") / "logs"
    group = ProcessGroup(log_dir=logs)
    try:
        decode = start_decode(group, "tcp", 32)
        wait_ready(decode)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", 32)
        wait_ready(prefill)
        yield {"prefill": prefill, "decode": decode, "logs": logs}
    finally:
        group.close()


def _raw(route: str, field: str, value: str) -> bytes:
    # the bad field comes last: a duplicate key ("max_tokens") takes the last value
    return ('{"model": "tiny", ' + ENDPOINTS[route] + ', "max_tokens": 2, "' + field + '": ' + value + "}").encode()


def _ok(prefill, route: str) -> None:
    status, body = post_json(prefill.url + route, None, raw=_raw(route, "temperature", "0"))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] >= 1


def test_bad_numbers_get_400_naming_the_field(servers):
    prefill = servers["prefill"]
    cases = [(route, f, v) for route in ENDPOINTS for f, v in BAD]
    cases += [("/v1/chat/completions", f, v) for f, v in CHAT_ONLY]
    cases += [("/v1/completions", f, v) for f, v in COMPLETION_ONLY]
    cases += [("/v1/completions", "prompt", v) for v in PROMPT_IDS]
    wrong = []
    for route, field, value in cases:
        raw = _raw(route, field, value)
        json.loads(raw)  # well-formed as far as Python's json goes (NaN/Infinity literals included)
        status, body = post_json(prefill.url + route, None, raw=raw)
        err = body.get("error") or {}
        if not (status == 400 and err.get("type") == "invalid_request_error" and err.get("param") == field
                and field in err.get("message", "")):
            wrong.append((route, field, value, status, body))
    assert not wrong, wrong[:5]
    assert len(cases) > 150
    # a number Python's json cannot hold (over 4300 digits) is invalid JSON, not a 500
    status, body = post_json(prefill.url + "/v1/completions", None, raw=_raw("/v1/completions", "seed", "9" * 5000))
    assert status == 400 and body["error"]["code"] == "invalid_json", body
    for route in ENDPOINTS:  # still serving
        _ok(prefill, route)


def test_grpc_generate_bad_numbers(servers):
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    prefill = servers["prefill"]
    bad = [({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
           ({"temperature": 1e-300}, "temperature"), ({"top_p": float("nan")}, "top_p"), ({"top_p": 1e308}, "top_p"),
           ({"top_k": -2}, "top_k"), ({"seed": -1}, "seed"), ({"max_tokens": 2**31 - 1}, "max_tokens"),
           ({"stop_token_ids": [2**31 - 1]}, "stop_token_ids"), ({"prompt_token_ids": [1, -5]}, "prompt_token_ids"),
           ({"prompt_token_ids": [1, 2**31 - 1]}, "prompt_token_ids")]
    with grpc.insecure_channel(prefill.grpc_address) as ch:
        stub = gpb_grpc.GeneratorStub(ch)
        for fields, param in bad:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(gpb.GenerateRequest(**{"prompt": "x", "max_tokens": 2, **fields}), timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, info.value)
            assert param in info.value.details(), (fields, info.value.details())
        got = list(stub.Generate(gpb.GenerateRequest(prompt="x", max_tokens=2, temperature=0.7, top_k=2**31 - 1,
                                                     seed=2**63 - 1), timeout=60))
        assert got[-1].finish_reason in ("stop", "length")


def test_nothing_held_and_no_tracebacks_afterwards(servers):
    prefill, decode = servers["prefill"], servers["decode"]
    for route in ENDPOINTS:
        _ok(prefill, route)
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings
    log = (servers["logs"] / "prefill.log").read_text(errors="replace")
    assert "Traceback" not in log and " 500 " not in log, log[-3000:]
