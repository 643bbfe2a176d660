"""The scale experiment's virtual clock (bench/experiments/virtual_*.py, scale_virtual.py): events in order, a tiny
workload's TTFT and TPOT worked out by hand from a tiny profile, prefix hits that cut the prefill's compute (and
the decode's KV moved), the router's policies, and ``pdserve bench experiment scale --clock virtual`` on a few
dozen of the trace's requests."""

import argparse
import json

import pytest

from pdserve.bench.experiments import scale
from pdserve.bench.experiments.virtual_clock import Clock, VRequest
from pdserve.bench.experiments.virtual_cluster import ClusterSpec, VirtualCluster
from pdserve.engine.sim.profile import FORMAT, parse_profile

# 2 layers, 512 KV bytes per token: a 64-token block is 16,384 bytes per layer
PROFILE = parse_profile({"format": FORMAT, "name": "tiny-test",
                         "model": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 32, "dtype": "float32",
                                   "vocab_size": 258, "context_length": 2048, "eos_token_ids": [257]},
                         "step": {"base_s": 0.01, "prefill_token_s": 0.001, "prefill_pair_s": 0.0,
                                  "decode_seq_s": 0.002, "decode_context_token_s": 0.0}})
FAST_LINK = {"link_gbps": 1e6, "link_latency_us": 0.0}


def cluster(**over) -> VirtualCluster:
    spec = dict(prefills=1, decodes=1, num_blocks=64, max_model_len=2048, **FAST_LINK)
    spec.update(over)
    return VirtualCluster(ClusterSpec(**spec), PROFILE)


def req(i: int, at: float, ids: list[int], out: int) -> VRequest:
    return VRequest(i, at, ids, len(ids), out)


def test_the_clock_runs_events_in_time_order_ties_as_scheduled_and_never_backwards():
    clock, seen = Clock(), []
    clock.at(2.0, lambda: seen.append(("b", clock.now)))
    clock.at(1.0, lambda: seen.append(("a1", clock.now)))
    clock.at(1.0, lambda: (seen.append(("a2", clock.now)), clock.at(1.5, lambda: seen.append(("c", clock.now)))))
    assert clock.next_time() == 1.0
    clock.run()
    assert seen == [("a1", 1.0), ("a2", 1.0), ("c", 1.5), ("b", 2.0)]
    assert clock.events == 4
    with pytest.raises(ValueError, match="in the past"):
        clock.at(1.0, lambda: None)


def test_one_request_ttft_and_tpot_by_hand_with_the_link_behind_the_compute():
    # the link carries one layer's 2 blocks (32,768 bytes) in 0.1 s
    c = cluster(link_gbps=32768 * 8 / 0.1 / 1e9, link_latency_us=0.0)
    r = req(0, 0.0, list(range(1, 129)), 3)
    facts = c.run([r])
    # prefill step: 0.01 + 128 x 0.001 = 0.138 s, two layers of 0.069 s; layer 0's KV leaves at 0.069, arrives 0.169;
    # layer 1's waits for the wire (0.169) and arrives 0.269: the first token waits for the last layer
    assert r.computed_at == pytest.approx(0.138)
    assert r.first_at == pytest.approx(0.269)
    # two decode steps of 0.01 + 0.002 s each
    assert r.finish_at == pytest.approx(0.269 + 2 * 0.012)
    res = r.result()
    assert res.ok and res.ttft == pytest.approx(0.269) and res.tpot == pytest.approx(0.012)
    assert facts["unfinished"] == 0 and facts["left_in_engines"] == 0
    assert c.prefills["p000"].in_flight == 0 and c.watches.watches["p000"].in_flight == 0
    decode = c.decodes["d000"]
    assert decode.blocks.num_free_blocks() == decode.blocks.num_blocks  # its blocks back (cached, evictable)


def test_prompts_waiting_in_the_engines_line_are_wanted_together_and_share_its_step():
    c = cluster()
    a = req(0, 0.0, list(range(1, 129)), 2)
    b, d = req(1, 0.05, list(range(2, 130)), 2), req(2, 0.05, list(range(3, 131)), 2)
    c.run([a, b, d])
    assert a.allocated_at == 0.0 and a.first_at == pytest.approx(0.138, abs=1e-6)  # alone: its step began when it came
    # b and d came during a's step: they waited in the engine's line, ungranted, until the next step's scheduling
    # wanted both (their decode allocated then); both prompts then share one step: 0.01 + 256 x 0.001
    assert b.allocated_at == d.allocated_at == pytest.approx(0.138, abs=1e-6)
    assert b.first_at == pytest.approx(0.138 + 0.266, abs=1e-6) and d.first_at == pytest.approx(0.404, abs=1e-6)


def test_a_request_behind_a_busy_engine_holds_no_decode_blocks_until_the_scheduler_wants_it():
    # a step computes at most 256 prompt tokens: a's 1024 take four steps of 0.01 + 256 x 0.001 = 0.266 s
    c = cluster(max_num_batched_tokens=256)
    a = req(0, 0.0, [1 + i % 200 for i in range(1024)], 2)
    b = req(1, 0.1, list(range(3, 131)), 2)  # 2 blocks + 2 tokens: 3 blocks on the decode
    prefill, decode = c.prefills["p000"], c.decodes["d000"]
    seen = {}

    def probe() -> None:
        seq = prefill.engine.scheduler.seqs["1"]
        seen[c.clock.now] = (b.decode, len(b.decode_table), seq in prefill.engine.scheduler.waiting,
                             seq.remote.asked, seq.remote.granted, decode.blocks.num_free_blocks())

    for t in (0.2, 0.5, 0.7, 0.9):
        c.clock.at(t, probe)
    c.run([a, b])
    a_blocks = 17  # 1024 + 2 tokens
    # during a's first three chunks b waits in the engine's line, not asked for: the decode holds only a's blocks
    for t in (0.2, 0.5, 0.7):
        assert seen[t] == ("", 0, True, False, False, 64 - a_blocks), t
    # the step of a's last chunk (from 0.798) leaves nothing of a ahead of b: the Scheduler asks for b then
    # (ask_ahead), its decode allocates and it is granted, and the next step computes it
    assert b.allocated_at == pytest.approx(3 * 0.266, abs=1e-6)
    assert seen[0.9] == ("d000", 3, True, True, True, 64 - a_blocks - 3)
    assert a.first_at == pytest.approx(4 * 0.266, abs=1e-6)
    assert b.first_at == pytest.approx(4 * 0.266 + 0.01 + 0.128, abs=1e-6)
    assert decode.blocks.num_free_blocks() == decode.blocks.num_blocks


def test_a_wanted_request_no_decode_can_take_waits_ungranted_until_a_decode_frees_blocks():
    c = cluster(num_blocks=8)  # the decode's 8 blocks: a (128 + 300 tokens) holds 7, b needs 3
    a, b = req(0, 0.0, list(range(1, 129)), 300), req(1, 0.05, list(range(2, 130)), 2)
    prefill, seen = c.prefills["p000"], {}

    def probe() -> None:
        seq = prefill.engine.scheduler.seqs["1"]
        seen["b"] = (b.decode, seq.remote.asked, seq.remote.granted, list(prefill.wanted) == [b])

    c.clock.at(1.0, probe)
    facts = c.run([a, b])
    assert seen["b"] == ("", True, False, True)  # wanted (the step after a's), no decode could take it: not granted
    # a's last token (299 decode steps of 0.012 s after its first) frees the decode: b is allocated, granted and
    # computed in the engine's next step
    assert a.finish_at == pytest.approx(0.138 + 299 * 0.012, abs=1e-6)
    assert b.allocated_at == pytest.approx(a.finish_at, abs=1e-9)
    assert b.first_at == pytest.approx(a.finish_at + 0.138, abs=1e-6)
    assert facts["unfinished"] == 0 and facts["left_in_engines"] == 0 and not prefill.wanted


def test_a_cached_prefix_cuts_the_prefill_and_the_kv_moved_and_prefix_routing_finds_it():
    first = list(range(1, 193))  # 3 blocks
    second = first[:128] + list(range(100, 164))  # its first 2 blocks are the first prompt's

    def serve(policy: str) -> tuple[VRequest, VRequest]:
        c = cluster(prefills=2, policy=policy)
        a, b = req(0, 0.0, first, 2), req(1, 10.0, second, 2)
        c.run([a, b])
        return a, b

    a, b = serve("prefix")
    assert b.prefill == a.prefill
    assert b.prefill_cached == 128  # the engine's own prefix hit: 2 blocks
    assert b.first_at - b.arrival == pytest.approx(0.01 + 64 * 0.001, abs=1e-6)  # only 64 tokens computed
    assert b.decode_cached_blocks == 2  # the decode held them too (a's finished KV): they did not move
    a, b = serve("round-robin")
    assert b.prefill != a.prefill and b.prefill_cached == 0
    assert b.first_at - b.arrival == pytest.approx(0.01 + 192 * 0.001, abs=1e-6)


def test_least_loaded_spreads_requests_in_flight_over_the_prefills():
    shared = list(range(1, 129))
    reqs = [req(i, 0.001 * i, shared + [130 + i] * 64, 50) for i in range(4)]
    c = cluster(prefills=2, policy="prefix", load_weight=1_000_000.0)
    c.run(reqs)
    assert [r.prefill for r in reqs].count("p000") == 2  # a request in flight outweighs any prompt
    assert all(r.finish_at is not None for r in reqs)


def _args(tmp_path, **over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    args = parser.parse_args(["--clock", "virtual", "--max-requests", "30", "--prefills", "2", "--decodes", "2",
                              "--arms", "round-robin,least-loaded,prefix", "--out", str(tmp_path)])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_the_cli_runs_the_trace_on_the_virtual_clock(tmp_path, capsys):
    assert scale.run(_args(tmp_path, jobs=2)) == 0  # two arms at a time, in forked processes
    doc = json.loads((tmp_path / "scale.json").read_text())
    assert doc["clock"] == "virtual"
    assert [r["arm"] for r in doc["runs"]] == ["round-robin", "least-loaded", "prefix"]
    for r in doc["runs"]:
        assert (r["requests"], r["failed"], r["unfinished"], r["left_in_engines"]) == (30, 0, 0, 0)
        assert r["ttft_p50_s"] > 0 and r["tpot_p50_s"] > 0 and 0 < r["prefill_busy_mean"] < 1
    assert set(doc["ratios"]) == {"least-loaded", "prefix"}
    assert doc["targets"]["prefix ttft_p99_s"]["verdict"] in ("met", "MISSED")
    assert "virtual prefix" in capsys.readouterr().out


def test_the_planner_arms_need_the_process_cluster(tmp_path):
    assert scale.run(_args(tmp_path, arms="day-planner")) == 2
