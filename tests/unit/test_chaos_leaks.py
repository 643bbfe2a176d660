"""bench chaos: what a server still holds, from its /metrics text and /health document."""

from pdserve.bench.chaos.leaks import held_from_health, held_from_metrics, leaks
from pdserve.metrics import ServerMetrics


def test_held_gauges_are_read_from_a_real_metrics_page():
    m = ServerMetrics(role="decode")
    m.kv_blocks_used.set(7)
    m.requests_waiting.set(2)
    m.kv_blocks_free.set(100)  # not something held
    held = held_from_metrics(m.render()[0].decode())
    assert held == {"pdserve_kv_blocks_used": 7.0, "pdserve_requests_running": 0.0, "pdserve_requests_waiting": 2.0,
                    "pdserve_requests_queued": 0.0}


def test_health_gives_sessions_cachestore_entries_and_in_flight():
    health = {"sessions": 3, "in_flight": 1, "kv_blocks_used": 9,
              "cachestore": {"pinned_entries": 2, "waiters": 0, "bytes_received": 65536, "connections": 1}}
    assert held_from_health(health) == {"sessions": 3.0, "in_flight": 1.0, "cachestore.pinned_entries": 2.0,
                                        "cachestore.waiters": 0.0}


def test_leaks_keep_only_what_is_not_zero():
    readings = {"decode-0": {"sessions": 0.0, "pdserve_kv_blocks_used": 0.0},
                "prefill-0": {"sessions": 2.0, "in_flight": 0.0, "cachestore.pinned_entries": 1.0}}
    assert leaks(readings) == {"prefill-0": {"sessions": 2.0, "cachestore.pinned_entries": 1.0}}
    assert leaks({"decode-0": {"sessions": 0.0}}) == {}
