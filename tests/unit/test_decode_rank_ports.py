"""The decode's per-rank push receiver ports (decode_server/rank_ports.py): --kv-rank-ports parsed (ports and
ranges, in order), a port listed twice, one of the server's own, too few for the ranks, or one another process
holds ends the decode at start with one line naming it; the default (--kv-port + 1 + rank) is checked the same
way. And through the real command: a decode whose rank port is taken exits before loading the model, naming the
port."""

import argparse
import socket
import subprocess
import sys

import pytest

from pdserve import defaults
from pdserve.decode_server.rank_ports import PortList, check_free, default_slice_ports, parse_ports, rank_ports


def _args(**kw) -> argparse.Namespace:
    base = dict(port=50052, http_port=8001, kv_port=50060, kv_pool="", kv_pool_port=50070, kv_rank_ports=None)
    return argparse.Namespace(**{**base, **kw})


def test_ports_and_ranges_parse_in_order():
    assert parse_ports("50061-50063,50070, 50065") == [50061, 50062, 50063, 50070, 50065]
    for bad in ("x", "5-3", "0", "70000", "1-2-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_ports(bad)


def test_the_default_is_kv_port_plus_one_plus_rank_then_the_slices():
    assert rank_ports(_args(), 2) == [50061, 50062]
    assert rank_ports(_args(), 1) == []  # the rank's receiver is the one on --kv-port
    assert rank_ports(_args(kv_port=0), 4) == []  # ephemeral ports (tests)
    assert rank_ports(_args(kv_rank_ports=[40000, 40001, 40002]), 2) == [40000, 40001, 40002]
    n = defaults.KV_SLICE_PORTS
    assert default_slice_ports(_args(), 2) == list(range(50063, 50063 + n))  # after the ranks'
    assert default_slice_ports(_args(), 1) == list(range(50061, 50061 + n))
    assert 50064 not in default_slice_ports(_args(port=50064), 1)  # one of the server's own: skipped
    assert default_slice_ports(_args(kv_rank_ports=[40000]), 1) == []  # the list says
    assert default_slice_ports(_args(kv_port=0), 1) == []


@pytest.mark.parametrize("kw, ranks, message", [
    (dict(kv_rank_ports=[40000, 40001, 40000]), 2, "port 40000 appears twice in --kv-rank-ports"),
    (dict(kv_rank_ports=[40000]), 2, "lists 1 port(s) for 2 tensor-parallel ranks"),
    (dict(kv_rank_ports=[40000, 50052]), 2, "--kv-rank-ports includes port 50052, which is --port"),
    (dict(kv_rank_ports=[8001, 40000]), 2, "includes port 8001, which is --http-port"),
    (dict(kv_rank_ports=[50060]), 1, "includes port 50060, which is --kv-port"),
    (dict(kv_pool="g:1", kv_pool_port=50062), 2, "--kv-port 50060 + 1 + rank (the default) includes port 50062, "
                                                 "which is --kv-pool-port"),
    (dict(port=50061), 2, "includes port 50061, which is --port"),
])
def test_a_clash_ends_the_decode_naming_the_port_and_the_flag(kw, ranks, message):
    with pytest.raises(SystemExit) as err:
        rank_ports(_args(**kw), ranks)
    assert message in str(err.value), err.value


def test_a_port_another_process_listens_on_is_refused_at_start():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as err:
            check_free("127.0.0.1", [port])
        assert f"port {port} of the per-rank push receivers" in str(err.value), err.value
    check_free("127.0.0.1", [port])  # free again


def test_the_list_is_handed_out_in_order_then_free_ports():
    ports = PortList([40000, 40001])
    assert [ports.take(), ports.take(), ports.take()] == [40000, 40001, 0]


def test_the_decode_command_exits_before_loading_naming_a_taken_rank_port():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "pdserve", "decode", "--host", "127.0.0.1", "--port", "0",
                               "--http-port", "0", "--kv-port", "0", "--kv-rank-ports", f"{port}", "--model", "tiny"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"port {port} of the per-rank push receivers" in done.stderr, done.stderr[-2000:]
