"""BatchRunner over a real BatchStore with a stand-in for the node (``run_line``): the bound on
lines in flight, retries of lines refused for lack of room, cancel, expiry, a crashing line."""

import asyncio
import json
import time

from pdserve.batch.lines import split_lines
from pdserve.batch.runner import BatchRunner, StoreThread
from pdserve.batch.store import BatchStore

CHAT = "/v1/chat/completions"
# only hang guards: each test takes well under a second, but its SQLite commits wait for the disk,
# which the suite's other workers (the image import, etcd) can keep busy for seconds (a 20 s guard
# failed once in CI)
HANG_GUARD_S = 120.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


def _content(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                               "body": {"model": "tiny", "messages": [], "n_": i}}) + "\n" for i in range(n)).encode()


class Node:
    """run_line: answers after ``gate`` opens; ``script`` maps a line's n_ to the statuses it answers in turn."""

    def __init__(self, script=None, gate: asyncio.Event | None = None):
        self.script, self.gate = script or {}, gate
        self.in_flight = self.peak = 0
        self.calls: list[int] = []

    async def __call__(self, url, body):
        i = body["n_"]
        self.calls.append(i)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0.001)
            statuses = self.script.get(i)
            status = statuses.pop(0) if statuses else 200
            if status == "crash":
                raise RuntimeError("boom")
            return status, f"r{i}", {"n": i}
        finally:
            self.in_flight -= 1


async def _setup(tmp_path, n, node, max_in_flight=2, clock=lambda: 1000):
    store = StoreThread(BatchStore(str(tmp_path / "b.sqlite")))
    f = await store("add_file", "batch", "in.jsonl", _content(n), 1000)
    b = await store("create_batch", f["id"], CHAT, "24h", None, 1000, 2000)
    runner = BatchRunner(store, node, max_in_flight, clock=clock, poll_s=0.02, retry_s=0.01)
    runner.start()
    return store, runner, b["id"]


async def _until(store, bid, statuses, timeout=HANG_GUARD_S / 2):
    deadline = time.monotonic() + timeout
    while (b := await store("batch", bid))["status"] not in statuses:
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: batch still {b['status']} after {timeout:g}s: {b}")
        await asyncio.sleep(0.01)
    return b


def _lines(store_obj, file_id):
    return [json.loads(x) for x in store_obj.file_content(file_id).decode().splitlines()]


def test_every_line_runs_once_with_at_most_max_in_flight(tmp_path):
    async def main():
        node = Node(script={3: [429, 503], 5: [400], 7: ["crash"]})
        store, runner, bid = await _setup(tmp_path, 12, node, max_in_flight=3)
        b = await _until(store, bid, ("completed",))
        await runner.stop()
        assert node.peak <= 3
        assert sorted(node.calls) == sorted(list(range(12)) + [3, 3]), "only the refused line ran again"
        assert b["request_counts"] == {"total": 12, "completed": 10, "failed": 2}
        out, err = _lines(store.store, b["output_file_id"]), _lines(store.store, b["error_file_id"])
        assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(12) if i not in (5, 7)]
        assert [(e["custom_id"], e["response"]["status_code"]) for e in err] == [("c5", 400), ("c7", 500)]
        assert runner.lines_run == 12 and runner.tasks == {} and runner.retry_at == {}
        store.close()

    run(main())


def test_cancel_cancels_lines_in_flight_and_keeps_finished_ones(tmp_path):
    async def main():
        gate = asyncio.Event()
        node = Node(gate=gate)
        store, runner, bid = await _setup(tmp_path, 6, node, max_in_flight=2)
        while node.in_flight < 2:
            await asyncio.sleep(0.01)
        await store("cancel", bid, 1001)
        runner.wake()
        b = await _until(store, bid, ("cancelled",))
        assert node.in_flight == 0, "the lines in flight were cancelled"
        assert b["request_counts"]["completed"] == 0 and b["output_file_id"] is None
        gate.set()
        await runner.stop()
        store.close()

    run(main())


def test_expiry_cancels_in_flight_lines_and_fails_the_rest(tmp_path):
    async def main():
        now = {"t": 1000}
        gate = asyncio.Event()
        node = Node(gate=gate)
        store, runner, bid = await _setup(tmp_path, 4, node, max_in_flight=1, clock=lambda: now["t"])
        while node.in_flight < 1:
            await asyncio.sleep(0.01)
        now["t"] = 2000  # expires_at
        b = await _until(store, bid, ("expired",))
        assert node.in_flight == 0 and b["expired_at"] == 2000
        assert b["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
        assert {e["error"]["code"] for e in _lines(store.store, b["error_file_id"])} == {"batch_expired"}
        await runner.stop()
        store.close()

    run(main())


def test_a_restart_resumes_pending_lines_only(tmp_path):
    async def main():
        path = str(tmp_path / "b.sqlite")
        store = StoreThread(BatchStore(path))
        f = await store("add_file", "batch", "in.jsonl", _content(5), 1)
        b = await store("create_batch", f["id"], CHAT, "24h", None, 1, 10**10)
        await store("start", b["id"], split_lines(_content(5), CHAT), 2)
        await store("record", b["id"], 1, True, {"custom_id": "c1", "done": "before"})
        node = Node()
        runner = BatchRunner(store, node, 2, poll_s=0.02)
        runner.start()
        done = await _until(store, b["id"], ("completed",))
        await runner.stop()
        assert sorted(node.calls) == [0, 2, 3, 4]
        assert [o["custom_id"] for o in _lines(store.store, done["output_file_id"])] == [f"c{i}" for i in range(5)]
        store.close()

    run(main())


def test_stop_returns_when_a_wake_comes_in_the_same_turn(tmp_path):
    """wake() (a line just ended) right before stop(), at any point of the loop: stop returns. On Python
    3.11 asyncio.wait_for swallowed the cancel when its event was set in the same turn, and stop()
    waited for ever (seen once in a busy CI run; 20 of 20 here with the loop idle in its wait)."""
    async def main():
        store = StoreThread(BatchStore(str(tmp_path / "b.sqlite")))
        for idle_s in (0.0, 0.05, 0.05, 0.05):  # 0.05: the loop is in its wait (any point must do)
            runner = BatchRunner(store, Node(), 1, clock=lambda: 1000, poll_s=30, retry_s=0.01)
            runner.start()
            await asyncio.sleep(idle_s)
            runner.wake()
            await asyncio.wait_for(runner.stop(), 10)  # hang guard: stop takes milliseconds
        store.close()

    run(main())
