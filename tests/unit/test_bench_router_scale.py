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
