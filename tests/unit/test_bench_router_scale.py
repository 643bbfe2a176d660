"""pdserve bench router-scale's own arithmetic and stand-in: the target rate from a profile and a trace
(by hand on a three-request trace), and the stand-in prefill's prefix cache publishing what the engine's
would (the new blocks stored in one event, one removal event per evicted block)."""

import asyncio
import json

import pytest

from pdserve.bench.router_scale.fleet import BLOCK_SIZE, StandIn
from pdserve.bench.router_scale.target import prefills_rate
from pdserve.engine.block_manager import reusable_hashes
from pdserve.engine.sim.profile import load_profile
from pdserve.kv_events import REMOVED, STORED


def test_target_rate_is_prefills_over_the_mean_busy_time(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
            {"timestamp": 1000, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 3]},
            {"timestamp": 2000, "input_length": 600, "output_length": 30, "hash_ids": [9, 10]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    st = load_profile("h200-llama3-8b").step

    def busy(new, cached):
        return st.prefill_token_s * new + st.prefill_pair_s * new * (cached + (new + 1) / 2) + st.base_s * new / 8192

    t = prefills_rate(trace, "h200-llama3-8b", prefills=64, step_tokens=8192)
    reuse = (busy(1024, 0) + busy(1500 - 1024, 1024) + busy(600, 0)) / 3  # request 2 finds blocks 1, 2 cached
    no_reuse = (busy(1024, 0) + busy(1500, 0) + busy(600, 0)) / 3
    assert t["reuse"]["rate_per_s"] == pytest.approx(64 / reuse)
    assert t["no_reuse"]["rate_per_s"] == pytest.approx(64 / no_reuse)
    assert t["target_per_s"] == pytest.approx(64 / reuse) and t["mean_cached_tokens_reuse"] == pytest.approx(1024 / 3)
    assert t["trace_rate_per_s"] == pytest.approx(3 / 2.0) and t["mean_output_tokens"] == pytest.approx(20)


def test_the_stand_in_publishes_stores_and_one_removal_per_evicted_block():
    async def main():
        s = StandIn(capacity=6, preload=0, prefill_s=0.0, itl_s=0.0, seed=0)
        sub = s.publisher.subscribe()
        a = list(range(BLOCK_SIZE * 4 + 1))  # 4 reusable blocks
        b = a[:BLOCK_SIZE * 2] + [7] * (BLOCK_SIZE * 3 + 1)  # shares 2 blocks with a, 3 new ones
        assert s.admit(a) == 0
        assert s.admit(b) == 2
        events = []
        while len(events) < 3:
            events += await s.publisher.next_events(sub)
        ha, hb = reusable_hashes(a, BLOCK_SIZE), reusable_hashes(b, BLOCK_SIZE)
        assert events[0] == (1, STORED, tuple(ha))
        assert events[1] == (2, STORED, tuple(hb[2:]))
        assert events[2] == (3, REMOVED, (ha[2],))  # 7 blocks held, 6 fit: the oldest not reused goes
        assert set(s.cache) == set(ha[:2]) | {ha[3]} | set(hb[2:])
        assert s.publisher.snapshot()[1] == sorted(s.cache)
        s.publisher.unsubscribe(sub)

    asyncio.run(main())


def test_an_interleaved_window_sends_every_other_request_through_the_router_and_splits_them_back():
    from pdserve.bench.router_scale.serving import sides, urls_of

    urls = urls_of("both", "R", ["a", "b", "c"])
    sent = [urls[i % len(urls)] for i in range(12)]  # client.send_all's round robin
    assert sent == ["R", "a", "R", "b", "R", "c"] * 2
    routed, direct = sides(list(range(12)), "both")
    assert [sent[i] for i in routed] == ["R"] * 6 and sorted(sent[i] for i in direct) == ["a", "a", "b", "b", "c", "c"]
    assert urls_of("router", "R", ["a"]) == ["R"] and urls_of("direct", "R", ["a", "b"]) == ["a", "b"]
    assert sides([1, 2], "router") == ([1, 2], []) and sides([1, 2], "direct") == ([], [1, 2])
    with pytest.raises(ValueError, match="via must be one of"):
        urls_of("sideways", "R", ["a"])


def test_core_capacity_takes_the_idle_share_out_of_the_cpu_per_request():
    from pdserve.bench.router_scale.serving import core_capacity

    # 10 s window, 300 requests, 1.2 s of CPU; idle the router takes 6% of its core (0.6 s of those 1.2)
    c = core_capacity(cpu_s=1.2, wall_s=10.0, quiet_util=0.06, requests=300)
    assert c["marginal_ms_per_request"] == pytest.approx(2.0)  # (1.2 - 0.6) / 300
    assert c["per_s"] == pytest.approx(0.94 / 0.002)  # the core left after the idle work, 2 ms a request
    assert c["naive_per_s"] == pytest.approx(250.0)  # 300 / 1.2: idle amortized at 30 req/s
    assert core_capacity(cpu_s=0.5, wall_s=10.0, quiet_util=0.06, requests=300)["per_s"] is None  # idle > window


def test_derive_pairs_each_router_window_with_its_direct_side_and_its_idle_share():
    from pdserve.bench.router_scale import derive

    def win(router, via, cpu, p50, p99, direct=None):
        w = {"router": router, "via": via, "router_cpu_s": cpu, "wall_s": 10.0, "ok": 200,
             "router_cpu_ms_per_request": cpu / 200 * 1e3, "router_quiet_cpu_util": 0.05,
             "ttft_p50_ms": p50, "ttft_p99_ms": p99}
        if direct:
            w["direct"] = {"ttft_p50_ms": direct[0], "ttft_p99_ms": direct[1]}
        return w

    out = {"windows": [win("branch", "router", 0.9, 5, 9), win("branch", "both", 0.7, 4.0, 8.0, (2.5, 5.0)),
                       win("baseline", "router", 1.3, 6, 12), win("baseline", "both", 1.0, 5.0, 11.0, (2.0, 4.0))],
           "streamed": {"router_cpu_s": 1.9, "wall_s": 10.0, "ok": 200, "stream_tokens": 11}}
    by = derive(out)["by_router"]
    assert by["branch"]["added_ttft"] == [{"p50_ms": 1.5, "p99_ms": 3.0, "router_p50_ms": 4.0, "router_p99_ms": 8.0,
                                           "direct_p50_ms": 2.5, "direct_p99_ms": 5.0}]
    assert by["branch"]["cpu_ms_per_request"] == [pytest.approx(4.5)]  # the router-only window, not the interleaved
    assert by["branch"]["marginal_ms_per_request"] == pytest.approx(2.0)  # (0.9 - 0.5) / 200
    assert by["baseline"]["marginal_ms_per_request"] == pytest.approx(4.0)
    assert by["marginal_ratio_baseline_over_branch"] == pytest.approx(2.0)
    assert by["marginal_ratios_per_round"] == [pytest.approx(2.0)]
    assert by["branch"]["core_capacity_per_s"] == pytest.approx(0.95 / 0.002)
    assert by["branch"]["cpu_ms_per_event"] == pytest.approx(0.5)  # (1.9 - 0.5) / 200 = 7 ms a stream; 5 ms over 10


def test_a_view_agrees_with_its_prefill_only_when_synced_at_the_same_epoch_seq_and_size():
    from pdserve.bench.router_scale.serving import agrees

    truth = {"epoch": "e1", "seq": 40, "blocks": 1000}
    view = {"epoch": "e1", "seq": 40, "synced": True, "blocks": 1000, "block_size": 64}
    assert agrees(view, truth)
    assert not agrees(None, truth)
    for key, value in (("seq", 39), ("epoch", "e0"), ("synced", False), ("blocks", 999)):
        assert not agrees({**view, key: value}, truth), key


def test_the_publisher_says_its_last_seq():
    async def main():
        s = StandIn(capacity=2, preload=0, prefill_s=0.0, itl_s=0.0, seed=0)
        assert s.publisher.seq == 0
        s.admit(list(range(BLOCK_SIZE * 3 + 1)))  # 3 blocks stored, 1 evicted: two events
        assert s.publisher.seq == 2 and len(s.cache) == 2

    asyncio.run(main())


def test_the_routers_own_time_is_matched_to_the_clients_requests_by_their_id():
    from pdserve.bench.router_scale.client import Result
    from pdserve.bench.router_scale.residence import summarize

    # an interleaved window of 6: the even ones through the router (ids 0, 2, 4), the odd ones direct
    results = [Result(0.0, 200, ttft=t) for t in (0.010, 0.003, 0.004, 0.003, 0.020, 0.003)]
    recorded = [{"seq": 7 + k, "request_s": a, "response_s": b, "body_s": a / 4, "decided_s": a / 2, "request_id": rid}
                for k, (a, b, rid) in enumerate(((0.001, 0.0005, "0"), (0.002, 0.0005, "2"), (0.004, 0.002, "4")))]
    s = summarize(recorded, results, routed_ids=[0, 2, 4])
    assert s["requests"] == 3 and s["matched"] == 3
    assert s["total"]["p50_ms"] == pytest.approx(2.5) and s["total"]["max_ms"] == pytest.approx(6.0)
    assert s["over_target"] == 1 and s["target_ms"] == 5.0  # 6 ms > 5 ms
    assert s["request_part"]["max_ms"] == pytest.approx(4.0) and s["response_part"]["p50_ms"] == pytest.approx(0.5)
    assert s["decided_part"]["max_ms"] == pytest.approx(2.0) and s["body_part"]["max_ms"] == pytest.approx(1.0)
    # TTFT less the router's own time: 10 - 1.5, 4 - 2.5, 20 - 6 ms
    less = s["ttft_less_router"]
    assert less["p50_ms"] == pytest.approx(8.5) and less["max_ms"] == pytest.approx(14)
    assert s["ttft_tail"] == [{"ttft_ms": pytest.approx(20.0), "router_ms": pytest.approx(6.0)}]
    failed = [Result(0.0, 503, ttft=0.001)] + results[1:]  # a request that failed is not matched
    assert summarize(recorded, failed, routed_ids=[0, 2, 4])["matched"] == 2


def test_the_hops_server_answers_each_request_once_its_body_is_in_keep_alive_and_split():
    from pdserve.bench.router_scale.hop import RESPONSE, Answer

    class Transport:
        def __init__(self):
            self.out: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.out.append(data)

    t = Transport()
    a = Answer()
    a.connection_made(t)
    body = b"x" * 1000
    req = b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 1000\r\n\r\n" + body
    a.data_received(req[:30])
    a.data_received(req[30:500])
    assert t.out == []  # headers or body not whole yet
    a.data_received(req[500:] + req[:100])  # the end of one request and the start of the next
    assert t.out == [RESPONSE]
    a.data_received(req[100:] + b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert t.out == [RESPONSE] * 3
