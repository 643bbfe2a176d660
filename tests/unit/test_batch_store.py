"""The Batch API's SQLite store and input checks: statuses, exactly-once lines, files, paging, locking."""

import json
import sqlite3

import pytest

from pdserve.batch.lines import BatchInputError, check_batch_params, check_upload, split_lines
from pdserve.batch.store import BatchStore, StoreInUse, error_line, response_line

CHAT = "/v1/chat/completions"


def _line(cid, url=CHAT, method="POST", body=None):
    return json.dumps({"custom_id": cid, "method": method, "url": url,
                       "body": body if body is not None
                       else {"model": "tiny", "messages": [{"role": "user", "content": cid}]}})


@pytest.fixture
def store(tmp_path):
    s = BatchStore(str(tmp_path / "d" / "batch.sqlite"))
    yield s
    s.close()


def _batch(store, lines, now=100):
    content = ("\n".join(lines) + "\n").encode()
    f = store.add_file("batch", "in.jsonl", content, now)
    b = store.create_batch(f["id"], CHAT, "24h", {"k": "v"}, now, now + 86400)
    assert b["status"] == "validating" and b["metadata"] == {"k": "v"} and b["request_counts"]["total"] == 0
    assert store.start(b["id"], split_lines(content, CHAT), now + 1)
    return b["id"]


def test_wal_mode_and_files_round_trip(store):
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    f = store.add_file("batch", "a.jsonl", b"{}\n", 5)
    assert store.file(f["id"]) == f and f["bytes"] == 3 and f["object"] == "file"
    assert store.file_content(f["id"]) == b"{}\n"
    assert store.file("file-nope") is None and store.file_content("file-nope") is None


def test_lifecycle_to_completed_with_output_and_error_files(store):
    bid = _batch(store, [_line("a"), "{nope", _line("b"), _line("c", url="/v1/embeddings")])
    b = store.batch(bid)
    assert b["status"] == "in_progress" and b["in_progress_at"] == 101
    assert b["request_counts"] == {"total": 4, "completed": 0, "failed": 2}
    pending = store.pending_lines(bid, 10)
    assert [(n, c) for n, c, _ in pending] == [(0, "a"), (2, "b")]
    assert store.pending_lines(bid, 10, skip={0}) == pending[1:]
    assert store.record(bid, 2, True, response_line("b", 200, "r2", {"x": 2}))
    assert not store.record(bid, 2, True, response_line("b", 200, "r2", {"x": 2})), "a line is recorded once"
    assert store.record(bid, 0, False, response_line("a", 400, "r0", {"error": {}}))
    assert store.count_pending(bid) == 0
    store.finalizing(bid, "completed", 200)
    assert store.batch(bid)["status"] == "finalizing"
    b = store.finish(bid, 201)
    assert b["status"] == "completed" and b["completed_at"] == 201 and b["finalizing_at"] == 200
    assert b["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    out = [json.loads(x) for x in store.file_content(b["output_file_id"]).decode().splitlines()]
    err = [json.loads(x) for x in store.file_content(b["error_file_id"]).decode().splitlines()]
    assert [o["custom_id"] for o in out] == ["b"] and out[0]["response"]["body"] == {"x": 2}
    assert [(e["custom_id"], (e["error"] or {}).get("code")) for e in err] == [("a", None), (None, "invalid_json_line"),
                                                                               ("c", "mismatched_url")]
    assert store.file(b["output_file_id"])["purpose"] == "batch_output"
    assert store.finish(bid, 300)["completed_at"] == 201, "finishing twice changes nothing"
    assert store.unfinished() == []


def test_no_error_file_when_every_line_succeeds(store):
    bid = _batch(store, [_line("a")])
    store.record(bid, 0, True, response_line("a", 200, "r", {}))
    store.finalizing(bid, "completed", 5)
    b = store.finish(bid, 6)
    assert b["output_file_id"] and b["error_file_id"] is None


def test_cancel_keeps_finished_lines_and_refuses_finished_batches(store):
    bid = _batch(store, [_line("a"), _line("b")])
    store.record(bid, 0, True, response_line("a", 200, "r", {}))
    b = store.cancel(bid, 50)
    assert b["status"] == "cancelling" and b["cancelling_at"] == 50
    assert store.cancel(bid, 51)["cancelling_at"] == 50, "cancelling twice is fine"
    b = store.finish(bid, 60)
    assert b["status"] == "cancelled" and b["cancelled_at"] == 60 and b["request_counts"]["completed"] == 1
    assert len(store.file_content(b["output_file_id"]).splitlines()) == 1 and b["error_file_id"] is None
    with pytest.raises(ValueError, match="cancelled"):
        store.cancel(_done(store), 70)
    with pytest.raises(KeyError):
        store.cancel("batch_nope", 70)


def _done(store):
    bid = _batch(store, [_line("z")])
    store.record(bid, 0, True, response_line("z", 200, "r", {}))
    store.finalizing(bid, "completed", 1)
    store.finish(bid, 2)
    return bid


def test_a_cancel_while_validating_wins_over_start(store):
    f = store.add_file("batch", "in.jsonl", (_line("a") + "\n").encode(), 1)
    b = store.create_batch(f["id"], CHAT, "24h", None, 1, 2)
    store.cancel(b["id"], 2)
    assert not store.start(b["id"], [("a", "{}", None)], 3)
    assert store.finish(b["id"], 4)["status"] == "cancelled"


def test_expiry_turns_pending_lines_into_batch_expired_errors(store):
    bid = _batch(store, [_line("a"), _line("b")])
    store.record(bid, 1, True, response_line("b", 200, "r", {}))
    store.finalizing(bid, "expired", 9, {"code": "batch_expired", "message": "too late"})
    b = store.finish(bid, 10)
    assert b["status"] == "expired" and b["expired_at"] == 10
    assert b["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    err = json.loads(store.file_content(b["error_file_id"]))
    assert err["custom_id"] == "a" and err["error"]["code"] == "batch_expired" and err["response"] is None


def test_failed_batch_and_listing_with_after(store):
    ids = []
    for i in range(5):
        f = store.add_file("batch", "x", b"{}", i)
        ids.append(store.create_batch(f["id"], CHAT, "24h", None, i, i + 1)["id"])
    store.fail(ids[0], [{"code": "empty_file", "message": "m", "line": None}], 9)
    assert (store.batch(ids[0])["status"] == "failed"
            and store.batch(ids[0])["errors"]["data"][0]["code"] == "empty_file")
    page, more = store.list_batches(2)
    assert [b["id"] for b in page] == ids[:2:-1][:2] and more
    page, more = store.list_batches(2, after=page[-1]["id"])
    assert [b["id"] for b in page] == [ids[2], ids[1]] and more
    page, more = store.list_batches(10, after=ids[1])
    assert [b["id"] for b in page] == [ids[0]] and not more
    with pytest.raises(KeyError):
        store.list_batches(2, after="batch_nope")
    assert [b["id"] for b in store.unfinished()] == ids[1:]


def test_state_survives_reopening_and_a_second_process_is_refused(tmp_path):
    path = str(tmp_path / "batch.sqlite")
    s = BatchStore(path)
    bid = _batch(s, [_line("a"), _line("b")])
    s.record(bid, 0, True, response_line("a", 200, "r", {}))
    with pytest.raises(StoreInUse, match="own --batch-db"):
        BatchStore(path)
    s.close()
    s = BatchStore(path)  # as after a restart: the recorded line stays done, the other is pending
    assert [b["id"] for b in s.unfinished()] == [bid]
    assert [n for n, _, _ in s.pending_lines(bid, 10)] == [1]
    assert not s.record(bid, 0, True, response_line("a", 200, "r", {}))
    s.close()


def test_a_failing_record_leaves_the_line_pending(store, monkeypatch):
    bid = _batch(store, [_line("a")])
    with pytest.raises(TypeError):  # not JSON-serialisable: the transaction rolls back
        store.record(bid, 0, True, {"bad": object()})
    assert store.count_pending(bid) == 1 and store.batch(bid)["request_counts"]["completed"] == 0
    assert store.record(bid, 0, True, response_line("a", 200, "r", {}))


def test_split_lines_gives_each_bad_line_its_error():
    lines = [_line("ok"), "not json", "[1]", json.dumps({"method": "POST"}), _line("ok"), _line("m", method="GET"),
             _line("u", url="/v1/completions"), json.dumps({"custom_id": "nb", "method": "POST", "url": CHAT}),
             _line("s", body={"model": "tiny", "messages": [], "stream": True}), "", "   "]
    got = split_lines("\n".join(lines).encode(), CHAT)
    codes = [(c, e and e["error"]["code"]) for c, _, e in got]
    assert codes == [("ok", None), (None, "invalid_json_line"), (None, "invalid_json_line"),
                     (None, "missing_custom_id"),
                     ("ok", "duplicate_custom_id"), ("m", "invalid_method"), ("u", "mismatched_url"),
                     ("nb", "missing_body"), ("s", "invalid_body")]
    assert got[1][2]["error"]["line"] == 2 and "line 2" in got[1][2]["error"]["message"]
    assert json.loads(got[0][1])["messages"][0]["content"] == "ok"


@pytest.mark.parametrize("content, code", [
    (b"x" * 101, "file_too_large"), (b"", "empty_file"), (b"\n \n", "empty_file"),
    (b"\xff\xfe{}", "invalid_file_format"),
    (b"a,b,c\n1,2,3\n", "invalid_file_format"), (b"[1]\n2\n", "invalid_file_format"),
])
def test_uploads_that_cannot_be_batch_input(content, code):
    with pytest.raises(BatchInputError) as info:
        check_upload(content, 100)
    assert info.value.code == code and info.value.param == "file"


def test_an_upload_with_one_json_object_line_is_jsonl():
    check_upload(b"garbage\n{}\n", 100)


@pytest.mark.parametrize("body, param", [
    ({"endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": "f", "endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "1h"}, "completion_window"),
    ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h", "metadata": {"a": 1}}, "metadata"),
])
def test_batch_params(body, param):
    with pytest.raises(BatchInputError) as info:
        check_batch_params(body)
    assert info.value.param == param
    assert (check_batch_params({"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h"})
            == ("f", CHAT, "24h", None))


def test_error_line_shape():
    e = error_line("c", {"code": "x", "message": "m"})
    assert e["id"].startswith("batch_req_") and e["response"] is None and e["custom_id"] == "c"
    r = response_line("c", 200, "rid", {"b": 1})
    assert r["response"] == {"status_code": 200, "request_id": "rid", "body": {"b": 1}} and r["error"] is None
    assert sqlite3.sqlite_version_info >= (3, 7, 0)
