"""The loop of `pdserve up --autoscale` (localcluster/autoscale.py) over a fake cluster whose
servers answer /metrics with real ServerMetrics renders: what it observes, which server it
drains, what it starts, what it records; and its flags."""

import argparse
import json
from types import SimpleNamespace

import pytest

from pdserve.localcluster import autoscale
from pdserve.localcluster.up import add_arguments
from pdserve.metrics import ServerMetrics
from pdserve.planner import PlannerConfig, PoolLimits


class FakeCluster:
    def __init__(self, prefills=1, decodes=2):
        self.metrics: dict[str, ServerMetrics] = {}
        self.list: list = []
        self.added, self.drained = [], []
        for role, n in (("prefill", prefills), ("decode", decodes)):
            for _ in range(n):
                self._new(role)

    def _new(self, role, state="ready"):
        name = f"{role}-{sum(s.role == role for s in self.list)}"
        server = SimpleNamespace(name=name, role=role, state=state, metrics_url=f"fake://{name}")
        self.metrics[name] = ServerMetrics(role)
        self.list.append(server)
        return server

    def servers(self, role):
        return [s for s in self.list if s.role == role]

    def add_server(self, role, now):
        server = self._new(role, state="starting")
        self.added.append(server.name)
        return server

    def drain_server(self, server):
        server.state = "draining"
        self.drained.append(server.name)

    def fetch(self, url):
        return self.metrics[url.removeprefix("fake://")].render()[0].decode()


def config(**kw):
    base = dict(decode=PoolLimits(1, 4), prefill=PoolLimits(1, 2), down_stabilisation_s=0.0, cooldown_s=0.0)
    return PlannerConfig(**{**base, **kw})


def run(scaler, cluster, times, tick=None):
    changes = []
    for t in times:
        if tick:
            tick(t)
        changes += scaler.step(t)
    return changes


def test_it_drains_the_least_loaded_decode_and_records_why(tmp_path):
    cluster = FakeCluster(decodes=2)
    for name, used, running in (("decode-0", 10, 3), ("decode-1", 2, 0)):
        m = cluster.metrics[name]
        m.kv_blocks_used.set(used), m.kv_blocks_free.set(100 - used), m.requests_running.set(running)
    events = tmp_path / "autoscale.jsonl"
    scaler = autoscale.LocalAutoscaler(cluster, config(), interval_s=1.0, window_s=2.0, events=events,
                                       say=lambda line: None, fetch=cluster.fetch)
    assert run(scaler, cluster, [0.0, 0.5]) == []                  # no decision before a whole window
    changes = run(scaler, cluster, [1.0, 2.0])
    assert [(d.pool, d.current, d.desired) for d in changes] == [("decode", 2, 1)]
    assert cluster.drained == ["decode-1"]                          # the idle one, not the one with 3 in flight
    assert len(scaler.active("decode")) == 1
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert {line["pool"] for line in lines} == {"prefill", "decode"}
    down = next(line for line in lines if line["pool"] == "decode")
    assert (down["current"] == 2 and down["desired"] == 1 and "KV" in down["reason"]
            and down["window"]["decode_kv"] == 0.06)
    run(scaler, cluster, [3.0, 4.0, 5.0, 6.0])
    assert cluster.drained == ["decode-1"]                          # at min 1: no further
    scaler.close()


def test_a_full_decode_pool_gets_another_decode(tmp_path):
    cluster = FakeCluster(decodes=1)
    m = cluster.metrics["decode-0"]
    m.kv_blocks_used.set(95), m.kv_blocks_free.set(5), m.requests_running.set(8)
    scaler = autoscale.LocalAutoscaler(cluster, config(), interval_s=1.0, window_s=2.0, say=lambda line: None,
                                       fetch=cluster.fetch)
    changes = run(scaler, cluster, [0.0, 1.0, 2.0])
    assert changes and changes[0].pool == "decode" and changes[0].desired >= 2
    assert cluster.added[0] == "decode-1"
    run(scaler, cluster, [3.0, 4.0])                                # still starting: not started again
    assert len(cluster.added) == changes[0].desired - 1
    scaler.close()


def test_a_paused_planner_neither_observes_nor_decides_and_its_window_starts_after():
    cluster = FakeCluster(decodes=2)                                # idle: a running planner would drain one
    for m in (cluster.metrics["decode-0"], cluster.metrics["decode-1"]):
        m.kv_blocks_used.set(2), m.kv_blocks_free.set(98)
    fetched, gate = [], {"closed": True}

    def fetch(url):
        fetched.append(url)
        return cluster.fetch(url)
    scaler = autoscale.LocalAutoscaler(cluster, config(), interval_s=1.0, window_s=2.0, say=lambda line: None,
                                       fetch=fetch, paused=lambda: gate["closed"])
    assert run(scaler, cluster, [0.0, 1.0, 2.0, 3.0, 4.0]) == [] and fetched == [] and cluster.drained == []
    gate["closed"] = False
    assert run(scaler, cluster, [5.0, 6.0]) == []                   # a whole window from the opening first
    assert [(d.pool, d.desired) for d in run(scaler, cluster, [7.0])] == [("decode", 1)]
    scaler.close()


def test_the_planner_gate_is_closed_only_while_on_and_not_opened(tmp_path):
    from pdserve.test_hooks import gate_closed
    assert not gate_closed("")                                       # the hook off: never held
    assert gate_closed(str(tmp_path))
    (tmp_path / "open").touch()
    assert not gate_closed(str(tmp_path))


def test_a_server_that_does_not_answer_is_left_out_of_the_round():
    cluster = FakeCluster(decodes=2)
    fetch = lambda url: None if url.endswith("decode-1") else cluster.fetch(url)  # noqa: E731
    scaler = autoscale.LocalAutoscaler(cluster, config(), fetch=fetch, say=lambda line: None)
    snap = scaler.observe(0.0)
    assert set(snap.decode) == {"decode-0"} and set(snap.prefill) == {"prefill-0"}
    scaler.close()


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--autoscale", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--decode", "5"], "--decode 5 is outside --min-decode 1 .. --max-decode 4"),
    (["--min-decode", "3", "--max-decode", "2", "--decode", "2"], "max_replicas"),
    (["--min-prefill", "0", "--prefill", "1"], "--min-prefill must be >= 1"),
    (["--plan-window", "1", "--plan-interval", "2"], "--plan-window must be >= --plan-interval"),
    (["--slo-ttft-ms", "0"], "ttft_target_s"),
])
def test_bad_autoscaling_flags_are_refused_by_name(argv, message):
    with pytest.raises(SystemExit, match=message):
        autoscale.planner_config(parse(*argv))


def test_the_flags_reach_the_planner():
    cfg = autoscale.planner_config(parse("--max-decode", "6", "--slo-ttft-ms", "500", "--scale-down-window", "40"))
    assert cfg.decode.max_replicas == 6 and cfg.ttft_target_s == 0.5 and cfg.down_stabilisation_s == 40
