"""The OpenAI Batch API over real processes (one decode, prefills with --batch-db), driven by
the real ``openai`` client.

- upload (files.create), create, poll (batches.retrieve), download (files.content): each good
  line's answer equals the online endpoint's for the same body (greedy); bad lines (not JSON,
  wrong url, no body, GET, duplicate custom_id) are per-line errors in the error file and
  the job completes; the lines ran in the SLO class ``batch``; batches.list pages with
  limit/after;
- cancel mid-job -> cancelled, with the lines that finished; online requests are served while
  a job runs, and at most --batch-max-in-flight lines are in flight;
- an oversized upload, a non-JSONL upload, a purpose other than batch, an unknown input
  file, an unknown batch: clear 4xx errors naming the problem; files.list and files.delete;
- a prefill SIGKILLed while lines are in flight, started again on the same database,
  finishes the job with every line in the output exactly once, and no line recorded
  before the kill runs again;
- after every test nothing is held, queued or in flight on either process.
"""

import json
import time

import pytest
from openai import BadRequestError, ConflictError, NotFoundError, OpenAI

from harness.pd_cluster import (get_json, metric, nothing_held, start_decode, start_prefill, wait_all_released,
                                wait_ready)
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CLASSES = {"classes": [{"name": "batch", "priority": 1}]}
MAX_FILE = 64 * 1024


def _prefill(group, decode, db, name, extra=()):
    return start_prefill(group, [decode.grpc_address], "tcp", 64, name=name, extra=[
        "--batch-db", str(db), "--batch-max-file-bytes", str(MAX_FILE), "--slo-classes", json.dumps(CLASSES),
        "--load-report-interval", "0.1", *extra])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    group = ProcessGroup(log_dir=tmp / "logs")
    try:
        decode = start_decode(group, "tcp", num_blocks=64, name="decode")
        db = tmp / "db" / "batch.sqlite"
        prefill = _prefill(group, decode, db, "prefill", ["--batch-max-in-flight", "2"])  # both load at once
        wait_ready(decode)
        wait_ready(prefill)
        yield {"group": group, "decode": decode, "prefill": prefill, "db": db}
    finally:
        group.close()


@pytest.fixture
def servers(cluster):
    yield cluster
    readings = wait_all_released([cluster["prefill"], cluster["decode"]], timeout=30.0)
    assert nothing_held(readings), readings


def _client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _chat_line(cid: str, text: str, max_tokens: int = 6, url: str = CHAT, **extra) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _upload(client, lines: list[str]) -> str:
    return client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch").id


def _wait(client, batch_id: str, statuses=("completed", "failed", "expired", "cancelled"), timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses or time.monotonic() > deadline:
            return b
        time.sleep(0.1)


def _jsonl(client, file_id: str) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_upload_create_poll_download_and_list(servers):
    client = _client(servers["prefill"])
    good = {f"g{i}": f"tell me about {i} cats" for i in range(4)}
    completion = json.dumps({"custom_id": "c0", "method": "POST", "url": COMPLETIONS,
                             "body": {"model": "tiny", "prompt": "x", "max_tokens": 3}})
    lines = [_chat_line(c, t) for c, t in good.items()] + [
        "{not json", _chat_line("wrong-url", "x", url="/v1/embeddings"), completion,
        json.dumps({"custom_id": "no-body", "method": "POST", "url": CHAT}),
        json.dumps({"custom_id": "get", "method": "GET", "url": CHAT, "body": {}}), _chat_line("g0", "again"),
        _chat_line("too-long", "x", max_tokens=10**6),
        _chat_line("n2", "two answers", n=2, logprobs=True, top_logprobs=2)]
    before = metric(servers["prefill"].url, "pdserve_slo_requests_total", slo_class="batch", outcome="ok")
    file_id = _upload(client, lines)
    assert client.files.retrieve(file_id).bytes == len(("\n".join(lines) + "\n").encode())
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"run": "1"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "1"}
    done = _wait(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 5, 7)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = _jsonl(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted([*good, "n2"])
    # a line gets what the online endpoint gives the same body: every choice, with its logprobs
    n2 = next(o for o in out if o["custom_id"] == "n2")["response"]["body"]
    assert [c["index"] for c in n2["choices"]] == [0, 1], n2
    assert all(len(c["logprobs"]["content"]) == c_tokens for c, c_tokens in
               zip(n2["choices"], [6, 6])), n2["choices"]
    out = [o for o in out if o["custom_id"] != "n2"]
    for o in out:  # the same answer as the online endpoint (greedy)
        assert o["id"].startswith("batch_req_") and o["error"] is None and o["response"]["status_code"] == 200
        online = client.chat.completions.create(model="tiny",
                                                messages=[{"role": "user", "content": good[o["custom_id"]]}],
                                                max_tokens=6, temperature=0)
        body = o["response"]["body"]
        assert (body["object"] == "chat.completion"
                and body["choices"][0]["message"]["content"] == online.choices[0].message.content)
        assert body["usage"]["completion_tokens"] == online.usage.completion_tokens
    errors = {(e["custom_id"], (e["error"] or {}).get("code") or e["response"]["status_code"])
              for e in _jsonl(client, done.error_file_id)}
    assert errors == {(None, "invalid_json_line"), ("wrong-url", "mismatched_url"), ("c0", "mismatched_url"),
                      ("no-body", "missing_body"), ("get", "invalid_method"), ("g0", "duplicate_custom_id"),
                      ("too-long", 400)}
    assert metric(servers["prefill"].url, "pdserve_slo_requests_total", slo_class="batch", outcome="ok") >= before + 4
    # list: newest first, paged by limit/after
    second = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    assert [b.id for b in client.batches.list(limit=1, after=second.id).data] == [batch.id]
    assert _wait(client, second.id).status == "completed"
    with pytest.raises(ConflictError, match="only a validating or in_progress batch"):
        client.batches.cancel(second.id)


def test_cancel_mid_job(servers):
    client = _client(servers["prefill"])
    file_id = _upload(client, [_chat_line(f"l{i}", f"count to {i}", max_tokens=40) for i in range(40)])
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    b = batch
    while b.status != "in_progress" or b.request_counts.completed < 1:
        b = client.batches.retrieve(batch.id)
        time.sleep(0.05)
    # online traffic is served meanwhile; batch lines never exceed --batch-max-in-flight
    online = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert online.choices[0].finish_reason == "length"
    assert get_json(servers["prefill"].url + "/health")[1]["batch"]["lines_in_flight"] <= 2
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at, done
    assert 1 <= done.request_counts.completed < 40 and done.request_counts.total == 40
    assert len(_jsonl(client, done.output_file_id)) == done.request_counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled", "cancelling twice changes nothing"


def test_refused_uploads_and_unknown_ids(servers):
    client = _client(servers["prefill"])
    with pytest.raises(BadRequestError, match="file_too_large|larger than"):
        client.files.create(file=("big.jsonl", (_chat_line("a", "x" * 100) + "\n").encode() * 400), purpose="batch")
    with pytest.raises(BadRequestError, match="not JSONL"):
        client.files.create(file=("t.csv", b"a,b\n1,2\n"), purpose="batch")
    with pytest.raises(BadRequestError, match="UTF-8"):
        client.files.create(file=("b.bin", b"\xff\xfe\x00{}"), purpose="batch")
    with pytest.raises(BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(BadRequestError, match="input_file_id"):
        client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    with pytest.raises(NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(NotFoundError):
        client.files.content("file-nope")
    file_id = _upload(client, [_chat_line("a", "x")])  # list and delete
    assert file_id in [f.id for f in client.files.list(purpose="batch", limit=5).data]
    assert client.files.delete(file_id).deleted
    with pytest.raises(NotFoundError):
        client.files.retrieve(file_id)


def test_restart_mid_job_finishes_every_line_exactly_once(servers):
    """Runs last: the module's prefill is SIGKILLed and replaced by one on the same database."""
    group, decode, first = servers["group"], servers["decode"], servers["prefill"]
    n = 16
    client = _client(first)
    file_id = _upload(client, [_chat_line(f"r{i}", f"story {i}", max_tokens=32) for i in range(n)])
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 60
    while True:  # kill it with some lines done and others in flight
        health = get_json(first.url + "/health")[1]
        b = client.batches.retrieve(batch.id)
        if b.request_counts.completed >= 2 and health["batch"]["lines_in_flight"] >= 1:
            break
        assert b.status in ("validating", "in_progress"), b
        assert time.monotonic() < deadline, (b, health)
        time.sleep(0.02)
    group.kill(first.proc)
    done_before = b.request_counts.completed  # read before the kill: at least this many were recorded
    assert done_before < n
    second = servers["prefill"] = _prefill(group, decode, servers["db"], "prefill-restarted",
                                           ["--batch-max-in-flight", "2"])
    wait_ready(second)
    client = _client(second)
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == n and done.request_counts.failed == 0, done
    out = _jsonl(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(n)), "every line exactly once"
    ran_after = get_json(second.url + "/health")[1]["batch"]["lines_run"]
    assert ran_after <= n - done_before, (ran_after, done_before)
