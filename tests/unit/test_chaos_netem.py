"""bench chaos --netem, pure parts: the decodes' ports from their command lines, the netem
spec, and the tc command lines (every one names the namespace; only the decodes' ports, both
directions, are steered into the shaped class)."""

import pytest

from pdserve.bench.chaos.faults import KINDS, FaultLoop
from pdserve.bench.chaos.netem import (
    clear_command, decode_ports, decode_ports_from_argv, htb_applied, htb_commands, loss_bytecode, namespace_name,
    netem_commands, parse_qdisc_stats, parse_spec,
)

NS = "pdchaos-4242"


def _up_argv(grpc, http, kv):  # what localcluster/up.py starts, as /proc/<pid>/cmdline shows it
    return ["/work/.venv/bin/python", "-m", "pdserve", "decode", "--port", str(grpc), "--http-port", str(http),
            "--kv-port", str(kv), "--model", "tiny", "--transfer", "tcp", "--num-blocks", "256", "--threads", "1",
            "--session-timeout", "10.0"]


def test_decode_ports_are_read_from_the_command_line():
    assert decode_ports_from_argv(_up_argv(41001, 41002, 41003)) == (41001, 41003)
    assert decode_ports_from_argv(["pdserve", "decode", "--kv-port=7", "--port=6"]) == (6, 7)
    with pytest.raises(ValueError):
        decode_ports_from_argv(["pdserve", "prefill", "--port", "8000", "--grpc-port", "50051"])
    with pytest.raises(ValueError):
        decode_ports_from_argv(["pdserve", "decode", "--port", "1"])


def test_decode_ports_of_every_decode_in_servers_json_not_the_prefill():
    servers = {"prefill-0": {"pid": 10, "state": "ready", "ready_url": "http://127.0.0.1:8000/ready"},
               "decode-0": {"pid": 11, "state": "ready", "ready_url": "http://127.0.0.1:41002/ready"},
               "decode-1": {"pid": 12, "state": "ready", "ready_url": "http://127.0.0.1:41005/ready"}}
    argv = {11: _up_argv(41001, 41002, 41003), 12: _up_argv(41004, 41005, 41006)}
    assert decode_ports(servers, argv.__getitem__) == [41001, 41003, 41004, 41006]  # no HTTP port
    with pytest.raises(ValueError):
        decode_ports({"prefill-0": servers["prefill-0"]}, argv.__getitem__)


def test_spec_is_parsed_and_bad_specs_are_refused():
    s = parse_spec("delay 50ms 20ms loss 2%")
    assert (s.delay, s.loss_pct, s.rate, s.text) == ("50ms 20ms", 2.0, None, "delay 50ms 20ms loss 2%")
    assert parse_spec("loss 0.5%  rate 100mbit").rate == "100mbit"
    assert parse_spec("delay 10ms").delay == "10ms"
    for bad in ("", "delay", "loss 2", "loss 200%", "delay 50ms; rm -rf /", "corrupt 1%"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_netem_commands_prio_band_4_with_netem_and_both_directions_of_each_port():
    cmds = netem_commands(NS, [41001, 41003], parse_spec("delay 50ms 20ms loss 2%"))
    assert all(c[:3] == ["tc", "-n", NS] for c in cmds)  # never the root namespace
    assert " ".join(cmds[0]) == (f"tc -n {NS} qdisc add dev lo root handle 1: prio bands 4 "
                                 "priomap 1 2 2 2 1 2 0 0 1 1 1 1 1 1 1 1")
    assert " ".join(cmds[1]) == f"tc -n {NS} qdisc add dev lo parent 1:4 handle 40: netem delay 50ms 20ms loss 2%"
    filters = [" ".join(c) for c in cmds[2:]]
    assert filters == [f"tc -n {NS} filter add dev lo parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff "
                       f"match ip {d} {p} 0xffff flowid 1:4" for p in (41001, 41003) for d in ("dport", "sport")]
    with pytest.raises(ValueError):
        netem_commands(NS, [], parse_spec("loss 1%"))


def test_htb_commands_without_netem_loss_goes_to_a_dropping_fifo():
    cmds = [" ".join(c) for c in htb_commands(NS, [41001], parse_spec("delay 50ms 20ms loss 2%"))]
    assert cmds[0] == f"tc -n {NS} qdisc add dev lo root handle 1: htb default 0 r2q 100000"  # unmatched: direct
    assert cmds[1] == f"tc -n {NS} class add dev lo parent 1: classid 1:1 htb rate 10gbit"
    assert f"tc -n {NS} qdisc add dev lo parent 10:2 handle 20: pfifo limit 0" in cmds
    assert any("bpf bytecode " + loss_bytecode(2.0) + " classid 10:2" in c for c in cmds)
    assert cmds[-2:] == [f"tc -n {NS} filter add dev lo parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff "
                         f"match ip {d} 41001 0xffff flowid 1:1" for d in ("dport", "sport")]
    assert htb_applied(parse_spec("delay 50ms 20ms loss 2%")) == ("loss 2%", "delay 50ms 20ms")
    no_loss = [" ".join(c) for c in htb_commands(NS, [1], parse_spec("rate 1mbit"))]
    assert "htb rate 1mbit" in no_loss[1] and not any("pfifo" in c for c in no_loss)


def test_loss_bytecode_is_classic_bpf_on_the_random_ancillary_load():
    assert loss_bytecode(2.0) == "5,32 0 0 4294963256,148 0 0 10000,53 1 0 200,6 0 0 4294967295,6 0 0 0"
    assert loss_bytecode(0.25).split(",")[3] == "53 1 0 25"


def test_clear_and_namespace_name():
    assert clear_command(NS) == ["tc", "-n", NS, "qdisc", "del", "dev", "lo", "root"]
    assert namespace_name(4242) == NS


def test_qdisc_stats_of_the_shaped_qdiscs():
    text = """qdisc htb 1: root refcnt 2 r2q 100000 default 0 direct_packets_stat 9 direct_qlen 1000
 Sent 200362 bytes 1411 pkt (dropped 589, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
qdisc htb 10: parent 1:1 r2q 100000 default 0 direct_packets_stat 1411 direct_qlen 1000
 Sent 200362 bytes 1411 pkt (dropped 589, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
qdisc pfifo 20: parent 10:2 limit 0p
 Sent 0 bytes 0 pkt (dropped 589, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""
    assert parse_qdisc_stats(text) == {"10:": {"sent_pkts": 1411, "dropped": 589},
                                       "20:": {"sent_pkts": 0, "dropped": 589}}


class FakeShaper:
    def __init__(self):
        self.calls = []

    def describe(self):
        return "fake"

    def apply(self):
        self.calls.append("apply")

    def clear(self):
        self.calls.append("clear")
        return {"40:": {"sent_pkts": 3, "dropped": 1}}


def test_fault_loop_netem_kind_applies_then_clears(tmp_path):
    import asyncio
    import random
    import time

    assert "netem" in KINDS
    with pytest.raises(ValueError):
        FaultLoop(tmp_path / "servers.json", random.Random(0), 1.0, (1, 2), ("netem",), time.perf_counter())
    shaper = FakeShaper()
    loop = FaultLoop(tmp_path / "servers.json", random.Random(0), 0.4, (1, 2), ("netem",), time.perf_counter(),
                     say=lambda *_: None, shaper=shaper, netem_s=(0.3, 0.3))
    asyncio.run(loop.run(1.0))
    assert loop.faults and all(f.kind == "netem" and f.netem == "fake" and f.netem_stats and f.recovered_at
                               for f in loop.faults)
    assert shaper.calls[:2] == ["apply", "clear"] and shaper.calls.count("apply") == len(loop.faults)
    loop.restore()
    assert shaper.calls[-1] == "clear"
