"""Chunked prefill through the servers: a short prompt that arrives behind a long one gets its first token
after one of the long prompt's chunks, not after its whole prefill.

The prefill's engine steps are given a floor (the test hook ``PDSERVE_TEST_PREFILL_STEP_FLOOR_S``), so
the long prompt's chunks (4 or more) take a floor each on any CPU and the short request, sent once the long
prompt holds its blocks in the engine (after its first step), reaches the engine while the long prompt
still has chunks to go. The assertion is on the order the prefill recorded (the short prompt's prefill
done before the long one's), not on a duration. Both texts equal the same prompts served one at a time
(afterwards); nothing is held after.
"""

import threading

import pytest

from harness.conditions import wait_until
from harness.pd_cluster import get_json, nothing_held, start_decode, start_prefill, wait_all_released, wait_ready
from pdserve.test_hooks import PREFILL_STEP_FLOOR_ENV

pytestmark = pytest.mark.slow

STEP_FLOOR_S = 1.0  # the long prompt's 4+ chunks: 4 s, of which the short request needs a fraction to arrive
LONG = [256] + [97 + i % 26 for i in range(1999)]  # chunks of at most 512 tokens (256 while a short one waits)
SHORT = [256] + [65 + i % 26 for i in range(30)]


def completion(prefill, rid: str, prompt: list[int]) -> list[int]:
    """The request's tokens over the prefill's gRPC Generate (its request id is ours: /debug/requests/<id>)."""
    import grpc

    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as ch:
        return [t for r in gpb_grpc.GeneratorStub(ch).Generate(
            gpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=4, temperature=0, request_id=rid), timeout=120)
            for t in r.token_ids]


def test_a_short_prompt_behind_a_long_one_waits_for_one_chunk(procs):
    decode = start_decode(procs, "tcp", num_blocks=128, name="decode")
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], "tcp", num_blocks=128,
                            extra=["--max-num-batched-tokens", "512", "--long-prefill-threshold", "256"],
                            env={PREFILL_STEP_FLOOR_ENV: str(STEP_FLOOR_S)})
    wait_ready(prefill)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("long", completion(prefill, "long", LONG)), daemon=True)
    thread.start()
    # the long prompt is in the prefill's engine: its blocks taken (published after its first step), chunks to go
    wait_until(lambda: get_json(f"{prefill.url}/health")[1]["kv_blocks_used"] > 0, "the long prompt in the engine")
    short = completion(prefill, "short", SHORT)
    thread.join(120)
    p_long = get_json(f"{prefill.url}/debug/requests/long")[1]
    p_short = get_json(f"{prefill.url}/debug/requests/short")[1]
    # alone, 512 tokens a step; beside the short prompt, 256: at least 4 chunks, 4 layers each
    assert len(p_long["layer_stored"]) >= 4 * 4 and len(p_long["layer_stored"]) % 4 == 0, p_long
    assert p_short["prefill_done"] < p_long["prefill_done"], (p_short, p_long)  # it passed the long prompt
    # the chunks of the long prompt stored before the short one's first token: the one running when it came
    # and the one it shared a step with (and, at most, the one it arrived during its admission)
    before = sum(1 for t in p_long["layer_stored"][::4] if t < p_short["prefill_done"])
    assert 1 <= before <= 3, (before, p_long, p_short)
    # the same prompts one at a time, afterwards (before, their prefix-cache hits would spare the chunks above)
    alone = {"long": completion(prefill, "long-alone", LONG), "short": completion(prefill, "short-alone", SHORT)}
    assert short == alone["short"] and out["long"] == alone["long"] and len(short) == 4
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings
