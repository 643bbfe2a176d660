"""With an ordering policy, what enters the prefill engine's own line is the SLO line's decision (one
prefill, one decode, real processes): while the engine's line holds a step's budget of prompt tokens
not yet computed (``--max-num-batched-tokens 64``, one 64-token prompt), later requests wait in the
admission line even though every decode has room, and the policy (edf here), not their arrival,
picks who the engine computes next.

The first request is held at the test's gate (after its decode's Allocation, before its prompt is
computed) until the test has seen both later requests in line, so the order does not depend on how
fast the box computes. Afterwards nothing is queued, running or held on either side.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.conditions import wait_until
from harness.gates import Gate
from harness.pd_cluster import (get_json, nothing_held, post_json, start_decode, start_prefill, wait_all_released,
                                wait_ready)
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

CLASSES = {"classes": [{"name": "interactive", "ttftMs": 1000}, {"name": "batch", "e2eMs": 600000}]}


def body(i: int) -> dict:
    return {"model": "tiny", "prompt": [(i * 11 + j) % 200 + 1 for j in range(64)], "max_tokens": 2,
            "temperature": 0}


def queued(prefill) -> int:
    return get_json(prefill.url + "/health")[1]["queued"]


def test_the_policy_picks_what_enters_the_prefill_engines_line(tmp_path):
    gate = Gate(tmp_path / "gate")
    with ProcessGroup(log_dir=tmp_path / "logs") as group, ThreadPoolExecutor(3) as pool:
        decode = start_decode(group, "tcp", 256)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", 256, env=gate.env, extra=[
            "--slo-classes", json.dumps(CLASSES), "--queue-policy", "edf", "--max-num-batched-tokens", "64"])
        wait_ready(decode)
        wait_ready(prefill)

        def send(i: int, cls: str):
            return pool.submit(post_json, prefill.url + "/v1/completions", body(i), 120, None, {"X-SLO-Class": cls})

        first = send(0, "batch")
        gate.wait_held(1)  # its 64 prompt tokens fill the engine's line
        later_batch = send(1, "batch")
        wait_until(lambda: queued(prefill) == 1, "the second batch request in line (the decode has room)")
        interactive = send(2, "interactive")
        wait_until(lambda: queued(prefill) == 2, "the interactive request in line behind it")
        gate.open()
        answers = {name: f.result() for name, f in
                   (("first", first), ("batch", later_batch), ("interactive", interactive))}
        assert all(status == 200 for status, _ in answers.values()), answers
        ids = {name: out["id"].removeprefix("cmpl-") for name, (_, out) in answers.items()}
        timings = {r["request_id"]: r for r in get_json(prefill.url + "/debug/requests")[1]["requests"]}
        allocated = {name: timings[rid]["allocated"] for name, rid in ids.items()}
        assert allocated["first"] < allocated["interactive"] < allocated["batch"], allocated
        readings = wait_all_released([prefill, decode])
        assert nothing_held(readings), readings
        health = get_json(prefill.url + "/health")[1]
        assert health["queued"] == 0 and health["slo_running"] == 0, health
