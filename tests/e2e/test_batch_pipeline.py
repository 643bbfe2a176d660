"""Batch jobs in throughput mode: ``pdserve batch-server`` (the Batch API whose lines run on a
2-stage TD-Pipe pipeline), driven by the real ``openai`` client over real processes.

- a job's every good line answers the one-process engine's greedy text for the same body
  (LLMEngine in this process), the pipeline executor ran them (its /health), a bad body is
  an error line and the job completes;
- the server SIGKILLed mid-job (only its own pid: its stage processes die with it, by their
  parent-death signal) and started again on the same database finishes the job with every
  line exactly once, and no line recorded before the kill runs again;
- after each test nothing is left in the engine or in flight.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from openai import OpenAI

from harness.pd_cluster import Server, get_json, wait_ready
from pdserve.engine import EngineConfig, LLMEngine, load_model
from pdserve.batch.pipeline.cli import parse_body
from pdserve.batch.pipeline.meta import load_meta
from pdserve.net import free_port

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


def _start(group, db, name):
    port = free_port()
    proc = group.pdserve("batch-server", "--port", str(port), "--batch-db", str(db), "--model", "tiny",
                         "--pipeline-stages", "2", "--schedule", "td-pipe", "--num-blocks", "96",
                         "--max-num-seqs", "16", "--log-level", "INFO", name=name)
    server = Server(proc, port, 0, 0, name)
    wait_ready(server)
    return server


def _client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _body(i: int, max_tokens: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"tell story number {i} " * (1 + i % 4)}],
            "max_tokens": max_tokens, "temperature": 0}


def _line(cid: str, body: dict) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": CHAT, "body": body})


def _expected(bodies: dict[str, dict]) -> dict[str, str]:
    """The one-process engine's greedy text for each body (parsed as the server parses it)."""
    torch.set_num_threads(1)
    tok = load_meta("tiny").tokenizer
    eng = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=256, max_num_seqs=16))
    for cid, body in bodies.items():
        ids, sp = parse_body(CHAT, body, tok)
        eng.add_request(cid, ids, sp)
    text: dict[str, str] = {}
    while eng.has_unfinished():
        for o in eng.step():
            text[o.request_id] = text.get(o.request_id, "") + o.text
    return text


def _wait(client, batch_id: str, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled") or time.monotonic() > deadline:
            return b
        time.sleep(0.2)


def _outputs(client, file_id) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def _idle(server) -> dict:
    """/health once the server holds no line (the caller asserts on it); 10 s is only a hang guard."""
    deadline = time.monotonic() + 10
    while True:
        h = get_json(server.url + "/health")[1]
        if (h["lines_in_engine"] == 0 and h["batch"]["lines_in_flight"] == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)  # a short pause: the server needs the CPU to finish its lines


def test_a_job_runs_on_the_pipeline_and_gives_the_one_process_greedy_text(procs, tmp_path):
    server = _start(procs, tmp_path / "db" / "batch.sqlite", "batch-server")
    client = _client(server)
    bodies = {f"r{i}": _body(i, 4 + 3 * i) for i in range(8)}
    lines = [_line(cid, b) for cid, b in bodies.items()]
    lines.insert(3, _line("bad", {"model": "tiny", "messages": "not a list", "max_tokens": 4}))
    file_id = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    done = _wait(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed, done.request_counts.total) == (8, 1, 9), done
    out = {o["custom_id"]: o for o in _outputs(client, done.output_file_id)}
    expected = _expected(bodies)
    assert {cid: o["response"]["body"]["choices"][0]["message"]["content"] for cid, o in out.items()} == expected
    assert all(o["response"]["status_code"] == 200 for o in out.values())
    errors = _outputs(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["bad"] and errors[0]["response"]["status_code"] == 400
    assert "messages" in errors[0]["response"]["body"]["error"]["message"]
    health = _idle(server)
    assert health["executor"] == "pipeline" and health["schedule"] == "td-pipe" and health["stages"] == 2, health
    assert health["batch"]["lines_run"] == 9 and health["lines_in_engine"] == 0, health


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_restart_mid_job_finishes_every_line_exactly_once(procs, tmp_path):
    db = tmp_path / "db" / "batch.sqlite"
    first = _start(procs, db, "batch-server")
    client = _client(first)
    n = 24
    bodies = {f"r{i}": _body(i, 40 + (i % 5) * 8) for i in range(n)}
    file_id = client.files.create(file=("in.jsonl", "\n".join(_line(c, b) for c, b in bodies.items()).encode()),
                                  purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 180
    while True:  # kill it with some lines done and others in the engine
        health = get_json(first.url + "/health")[1]
        b = client.batches.retrieve(batch.id)
        if b.request_counts.completed >= 2 and health["lines_in_engine"] >= 1:
            break
        assert b.status in ("validating", "in_progress"), b
        assert time.monotonic() < deadline, (b, health)
        time.sleep(0.05)
    stages = _children(first.proc.pid)
    assert len(stages) >= 2, stages
    os.kill(first.proc.pid, signal.SIGKILL)  # the server only: its stages must not outlive it
    first.proc.wait(timeout=30)
    done_before = b.request_counts.completed
    assert done_before < n
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in stages):
        assert time.monotonic() < deadline, f"stage processes {stages} outlived their killed server"
        time.sleep(0.1)
    second = _start(procs, db, "batch-server-restarted")
    client = _client(second)
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == n and done.request_counts.failed == 0, done
    out = _outputs(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(bodies), "every line exactly once"
    expected = _expected(bodies)
    assert {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in out} == expected
    health = _idle(second)
    assert health["batch"]["lines_run"] <= n - done_before, (health, done_before)
    assert health["lines_in_engine"] == 0, health
