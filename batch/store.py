"""BatchStore: the Batch API's files, jobs and lines in one SQLite database (WAL mode).

Synchronous and single-connection: the server calls it from one worker thread
(``runner.StoreThread``); the unit tests call it directly. Every change is one
transaction (``BEGIN IMMEDIATE``), so a process killed at any instant leaves either the
state before or after a change, never half of one.

Tables: ``files`` (uploads and the output/error files, content as a BLOB), ``batches``
(one row per job: status, timestamps, counts, file ids) and ``lines`` (one row per input
line: ``pending`` until its result is recorded, then ``done`` with the output line's JSON).
``record`` turns a line done and counts it in the same transaction, and only if it was
still pending: a line finishes exactly once, and a line in flight when the process died is
still pending and simply runs again. ``finish`` writes the output and error files from
the done lines and sets the final status in one transaction.

Statuses: validating -> in_progress -> finalizing -> completed | expired;
validating -> failed (the input could not be used at all); validating/in_progress ->
cancelling -> cancelled.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import uuid
from contextlib import contextmanager

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
CANCELLABLE = ("validating", "in_progress")
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, final_status TEXT,
    created_at INTEGER NOT NULL, in_progress_at INTEGER, expires_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT, body TEXT, state TEXT NOT NULL,
    ok INTEGER, result TEXT, PRIMARY KEY (batch_id, line_no)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, state, line_no);
"""


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class StoreInUse(RuntimeError):
    """Another process (or store) holds the database: two runners would run the same lines."""


class BatchStore:
    def __init__(self, path: str):
        """Opens (creating) the database at ``path`` and holds an exclusive lock on ``path + '.lock'``
        while open (StoreInUse when another process holds it)."""
        self.path, self._lock = path, None
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._lock = open(path + ".lock", "a+")
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock.close()
                raise StoreInUse(f"batch database {path} is in use by another process; give each prefill its own "
                                 f"--batch-db") from None
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash; fsync at checkpoints
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()
        if self._lock is not None:
            self._lock.close()  # releases the lock
            self._lock = None

    @contextmanager
    def _tx(self):
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # -- files ----------------------------------------------------------------------------
    def add_file(self, purpose: str, filename: str, content: bytes, now: int, db=None) -> dict:
        fid = new_id("file-")
        (db or self.db).execute("INSERT INTO files (id, purpose, filename, bytes, created_at, "
                                "content) VALUES (?,?,?,?,?,?)", (fid, purpose, filename, len(content), now, content))
        return {"id": fid, "object": "file", "bytes": len(content), "created_at": now, "filename": filename,
                "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}

    def file(self, file_id: str) -> dict | None:
        row = self.db.execute("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id=?",
                              (file_id,)).fetchone()
        if row is None:
            return None
        return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
                "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
                "status_details": None}

    def list_files(self, limit: int, after: str | None = None, purpose: str | None = None) -> tuple[list[dict], bool]:
        """Newest first; ``after`` a file id: those uploaded before it; ``purpose`` filters. (page, has_more)."""
        where, params = [], []
        if after is not None:
            row = self.db.execute("SELECT seq FROM files WHERE id=?", (after,)).fetchone()
            if row is None:
                raise KeyError(after)
            where.append("seq<?")
            params.append(row["seq"])
        if purpose is not None:
            where.append("purpose=?")
            params.append(purpose)
        rows = self.db.execute(f"SELECT id FROM files "
                               f"{'WHERE ' + ' AND '.join(where) if where else ''} ORDER BY seq DESC LIMIT ?",
                               (*params, limit + 1)).fetchall()
        return [self.file(r["id"]) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM files WHERE id=?", (file_id,)).rowcount == 1

    def file_content(self, file_id: str) -> bytes | None:
        row = self.db.execute("SELECT content FROM files WHERE id=?", (file_id,)).fetchone()
        return None if row is None else bytes(row["content"])

    # -- batches --------------------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None,
                     now: int, expires_at: int) -> dict:
        bid = new_id("batch_")
        with self._tx() as db:
            db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, "
                       "expires_at, metadata) VALUES (?,?,?,?,?,?,?,?)",
                       (bid, endpoint, input_file_id, completion_window, "validating", now, expires_at,
                        None if metadata is None else json.dumps(metadata)))
        return self.batch(bid)

    def batch(self, batch_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM batches WHERE id=?", (batch_id,)).fetchone()
        return None if row is None else _batch_object(row)

    def list_batches(self, limit: int, after: str | None = None) -> tuple[list[dict], bool]:
        """Newest first; ``after`` a batch id: those created before it. (page, has_more)."""
        if after is not None:
            row = self.db.execute("SELECT seq FROM batches WHERE id=?", (after,)).fetchone()
            if row is None:
                raise KeyError(after)
            rows = self.db.execute("SELECT * FROM batches WHERE seq<? ORDER BY seq DESC LIMIT ?",
                                   (row["seq"], limit + 1)).fetchall()
        else:
            rows = self.db.execute("SELECT * FROM batches ORDER BY seq DESC LIMIT ?", (limit + 1,)).fetchall()
        return [_batch_object(r) for r in rows[:limit]], len(rows) > limit

    def unfinished(self) -> list[dict]:
        rows = self.db.execute(f"SELECT * FROM batches WHERE status IN "
                               f"({','.join('?' * len(UNFINISHED))}) ORDER BY seq",
                               UNFINISHED).fetchall()
        return [_batch_object(r) for r in rows]

    def start(self, batch_id: str, lines: list[tuple[str | None, str | None, dict | None]], now: int) -> bool:
        """validating -> in_progress with its lines: (custom_id, body JSON, None) to run, or
        (custom_id, None, output line) for a line that is already an error. False when the
        batch was no longer validating (cancelled meanwhile)."""
        with self._tx() as db:
            if db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()["status"] != "validating":
                return False
            failed = 0
            for no, (custom_id, body, error) in enumerate(lines):
                if error is None:
                    db.execute("INSERT INTO lines (batch_id, line_no, custom_id, body, state) "
                               "VALUES (?,?,?,?,'pending')", (batch_id, no, custom_id, body))
                else:
                    failed += 1
                    db.execute("INSERT INTO lines (batch_id, line_no, custom_id, state, ok, result) "
                               "VALUES (?,?,?,'done',0,?)", (batch_id, no, custom_id, json.dumps(error)))
            db.execute("UPDATE batches SET status='in_progress', in_progress_at=?, total=?, failed=? WHERE id=?",
                       (now, len(lines), failed, batch_id))
        return True

    def fail(self, batch_id: str, errors: list[dict], now: int) -> None:
        """validating -> failed: the input cannot be used at all (e.g. no line in it)."""
        with self._tx() as db:
            db.execute("UPDATE batches SET status='failed', failed_at=?, errors=? WHERE id=? AND status='validating'",
                       (now, json.dumps({"object": "list", "data": errors}), batch_id))

    def pending_lines(self, batch_id: str, limit: int, skip: set[int] = frozenset()) -> list[tuple[int, str, str]]:
        """Up to ``limit`` pending lines (line_no, custom_id, body) in order, not counting those in ``skip``."""
        rows = self.db.execute("SELECT line_no, custom_id, body FROM lines WHERE batch_id=? AND state='pending' "
                               "ORDER BY line_no LIMIT ?", (batch_id, limit + len(skip))).fetchall()
        return [(r[0], r[1], r[2]) for r in rows if r[0] not in skip][:limit]

    def count_pending(self, batch_id: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM lines WHERE batch_id=? AND state='pending'",
                               (batch_id,)).fetchone()[0]

    def record(self, batch_id: str, line_no: int, ok: bool, result: dict) -> bool:
        """A line's output line, recorded and counted once: False when it was not pending."""
        with self._tx() as db:
            cur = db.execute("UPDATE lines SET state='done', ok=?, result=?, body=NULL WHERE batch_id=? AND line_no=? "
                             "AND state='pending'", (int(ok), json.dumps(result), batch_id, line_no))
            if cur.rowcount != 1:
                return False
            db.execute(f"UPDATE batches SET {'completed=completed+1' if ok else 'failed=failed+1'} WHERE id=?",
                       (batch_id,))
        return True

    def cancel(self, batch_id: str, now: int) -> dict:
        """validating/in_progress -> cancelling (a batch already cancelling or cancelled: unchanged).
        ValueError naming the status when it cannot be cancelled; KeyError when unknown."""
        with self._tx() as db:
            row = db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row is None:
                raise KeyError(batch_id)
            if row["status"] in CANCELLABLE:
                db.execute("UPDATE batches SET status='cancelling', cancelling_at=?, "
                           "final_status='cancelled' WHERE id=?", (now, batch_id))
            elif row["status"] not in ("cancelling", "cancelled"):
                raise ValueError(f"batch {batch_id} is {row['status']}; only a validating or "
                                 f"in_progress batch can be cancelled")
        return self.batch(batch_id)

    def finalizing(self, batch_id: str, final_status: str, now: int, expired_error: dict | None = None) -> None:
        """in_progress -> finalizing towards ``final_status`` (completed or expired); expiring,
        every pending line becomes an error line (``expired_error`` is its error object)."""
        with self._tx() as db:
            if expired_error is not None:
                rows = db.execute("SELECT line_no, custom_id FROM lines WHERE batch_id=? AND state='pending'",
                                  (batch_id,)).fetchall()
                for no, custom_id in rows:
                    db.execute("UPDATE lines SET state='done', ok=0, body=NULL, result=? "
                               "WHERE batch_id=? AND line_no=?",
                               (json.dumps(error_line(custom_id, expired_error)), batch_id, no))
                db.execute("UPDATE batches SET failed=failed+? WHERE id=?", (len(rows), batch_id))
            db.execute("UPDATE batches SET status='finalizing', finalizing_at=?, final_status=? WHERE id=? AND "
                       "status='in_progress'", (now, final_status, batch_id))

    def finish(self, batch_id: str, now: int) -> dict:
        """finalizing/cancelling -> its final status, with the output file (lines that got a 2xx)
        and the error file (every other finished line), each only when not empty, in line order."""
        with self._tx() as db:
            row = db.execute("SELECT status, final_status FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row["status"] not in ("finalizing", "cancelling"):
                return self.batch(batch_id)
            final = row["final_status"] or ("cancelled" if row["status"] == "cancelling" else "completed")
            out, err = [], []
            for ok, result in db.execute("SELECT ok, result FROM lines WHERE batch_id=? AND "
                                         "state='done' ORDER BY line_no", (batch_id,)):
                (out if ok else err).append(result)
            ids = {}
            for kind, texts in (("output", out), ("error", err)):
                if texts:
                    content = ("\n".join(texts) + "\n").encode()
                    ids[kind] = self.add_file("batch_output", f"{batch_id}_{kind}.jsonl", content, now, db)["id"]
            db.execute(f"UPDATE batches SET status=?, {final}_at=?, output_file_id=?, error_file_id=? WHERE id=?",
                       (final, now, ids.get("output"), ids.get("error"), batch_id))
        return self.batch(batch_id)


def error_line(custom_id: str | None, error: dict) -> dict:
    """An output line for a request that never reached the model (``error`` = {code, message})."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None, "error": error}


def response_line(custom_id: str, status_code: int, request_id: str, body: dict) -> dict:
    """An output line for a request the server answered (2xx: the output file; else the error file)."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None}


def _batch_object(row: sqlite3.Row) -> dict:
    out = {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
           "errors": None if row["errors"] is None else json.loads(row["errors"]),
           "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
           "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"]}
    out.update({t: row[t] for t in _TIMES})
    out["request_counts"] = {"total": row["total"], "completed": row["completed"], "failed": row["failed"]}
    out["metadata"] = None if row["metadata"] is None else json.loads(row["metadata"])
    return out
