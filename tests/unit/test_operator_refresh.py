"""Status refreshes are coalesced per InferenceService and never lose a request (no cluster: _refresh_once is replaced)."""  # noqa: E501

import threading
import time

import kopf
import pytest

from pdserve.operator import handlers


@pytest.fixture
def memo():
    m = kopf.Memo()
    m.status_state = {}
    m.status_guard = threading.Lock()
    return m


def test_calls_during_a_refresh_cause_exactly_one_more(monkeypatch, memo):
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow_refresh(api, namespace, name):
        calls.append(name)
        if len(calls) == 1:
            started.set()
            release.wait(10)

    monkeypatch.setattr(handlers, "_refresh_once", slow_refresh)
    first = threading.Thread(target=handlers.refresh_status, args=(None, memo, "ns", "chat"))
    first.start()
    assert started.wait(10)
    for _ in range(5):  # a burst of Deployment events while the first refresh runs: all return at once
        handlers.refresh_status(None, memo, "ns", "chat")
    handlers.refresh_status(None, memo, "ns", "other")  # another service is not held up
    assert calls == ["chat", "other"]
    release.set()
    first.join(10)
    assert calls == ["chat", "other", "chat"]  # the burst became one more read of everything
    assert memo.status_state["ns/chat"] == {"running": False, "dirty": False}


def test_a_failed_refresh_does_not_block_later_ones(monkeypatch, memo):
    def broken(api, namespace, name):
        raise RuntimeError("API down")

    monkeypatch.setattr(handlers, "_refresh_once", broken)
    with pytest.raises(RuntimeError):
        handlers.refresh_status(None, memo, "ns", "chat")
    done = []
    monkeypatch.setattr(handlers, "_refresh_once", lambda api, namespace, name: done.append(name))
    handlers.refresh_status(None, memo, "ns", "chat")
    assert done == ["chat"]


def test_concurrent_callers_never_leave_a_request_unserved(monkeypatch, memo):
    """Hammer it from many threads: after all return, the last refresh started after the last request."""
    last_request, last_start = [0.0], [0.0]

    def refresh(api, namespace, name):
        last_start[0] = time.monotonic()
        time.sleep(0.001)

    monkeypatch.setattr(handlers, "_refresh_once", refresh)

    def caller():
        for _ in range(200):
            last_request[0] = max(last_request[0], time.monotonic())
            handlers.refresh_status(None, memo, "ns", "chat")

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert last_start[0] >= last_request[0] - 0.002  # the final request was picked up by a refresh
    assert memo.status_state["ns/chat"]["running"] is False
