"""Mutual TLS and bind tokens with real servers (issue 49 items 2 and 3): a prefill and a decode that
speak mutual TLS (--tls-cert/--tls-key/--tls-ca), and strangers who know a live request's id.

A request is held at the prefill's gate right after its decode's Allocation (the decode has pinned its
blocks and expects its KV; the test hook ``PDSERVE_TEST_GATE_AFTER_ALLOCATION``). Meanwhile:

* a stranger without a certificate, and one with a valid certificate of another CA, connect to the
  decode's KV port: refused at the TLS handshake, so they never reach HELLO;
* the same two dial the decode's gRPC port (load report, a Session for the live id): UNAVAILABLE;
* an insider with a certificate of the right CA (a compromised peer) gets past TLS and HELLO, but its
  BIND and DATA for the live request carry a guessed bind token: both refused, the entry untouched.

Then the gate opens: the live stream's text equals the same prompt's text served alone; the decode
counted the refusals (``tls_refused``, ``binds_refused``); nothing stays held anywhere. And with TLS on,
P/D serves the same texts as with it off.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from harness import kv_attacker as attacker
from harness.gates import Gate
from harness.pd_cluster import (get_json, nothing_held, post_json, start_decode, start_prefill, wait_all_released,
                                wait_ready)
from pdserve import tls, tls_certs
from pdserve.protos import session_pb2 as pb
from pdserve.protos import session_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
MAX_TOKENS = 12
RPC_TIMEOUT_S = 10.0  # a hang guard: a refused handshake fails in milliseconds


@pytest.fixture
def certs(tmp_path):
    """Ours (one CA, a certificate for the servers and one for an insider), and a stranger's: a valid
    certificate of another CA (another InferenceService's)."""
    ca, other = tls_certs.make_ca("this service"), tls_certs.make_ca("another service")
    return {
        "servers": tls_certs.write(str(tmp_path / "servers"), "node", tls_certs.issue(ca, "servers"), ca),
        "insider": tls_certs.write(str(tmp_path / "insider"), "node", tls_certs.issue(ca, "insider"), ca),
        "stranger": tls_certs.write(str(tmp_path / "stranger"), "node", tls_certs.issue(other, "stranger"), other),
    }


def _complete(prefill, prompt: str) -> str:
    status, body = post_json(prefill.url + "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                               "max_tokens": MAX_TOKENS, "temperature": 0,
                                                               "ignore_eos": True})
    assert status == 200, body
    return body["choices"][0]["text"]


def _cluster(procs, files, env=None):
    flags = tls.flags(files)
    decode = start_decode(procs, extra=flags)
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], extra=flags, env=env)
    wait_ready(prefill)
    return decode, prefill


def _grpc_refused(address: str, files, rid: str) -> str:
    """The status a client with ``files`` (None: no TLS at all) gets from the decode's gRPC port, for a
    load report and for a Session naming a live request."""
    codes = []
    with tls.channel(address, files) as channel:
        stub = pb_grpc.DecodeStub(channel)
        for call in (lambda: stub.GetLoadReport(pb.LoadReportRequest(), timeout=RPC_TIMEOUT_S),
                     lambda: list(stub.Session(iter([pb.PrefillMessage(start=pb.Start(request_id=rid))]),
                                               timeout=RPC_TIMEOUT_S))):
            with pytest.raises(grpc.RpcError) as info:
                call()
            codes.append(info.value.code())
    assert set(codes) == {grpc.StatusCode.UNAVAILABLE}, codes
    return "refused"


def test_strangers_cannot_push_kv_for_a_live_request(procs, tmp_path, certs):
    gate = Gate(tmp_path / "gate")
    decode, prefill = _cluster(procs, certs["servers"], env=gate.env)
    result: dict = {}
    live = threading.Thread(target=lambda: result.update(text=_complete(prefill, PROMPTS[0])))
    live.start()
    rid = gate.wait_held(1)[0]  # the decode expects its KV now

    stranger = certs["stranger"]
    ca = certs["servers"].ca
    for name, ctx in [("no certificate", attacker.client_context(None, None, ca)),
                      ("another CA's certificate", attacker.client_context(stranger.cert, stranger.key, ca))]:
        with pytest.raises(attacker.Refused):
            attacker.learn_compat(decode.kv_port, ctx)
    with pytest.raises(attacker.Refused):  # plain TCP: what it sends is no TLS handshake
        attacker.learn_compat(decode.kv_port, None)
    for files in (None, stranger):
        assert _grpc_refused(decode.grpc_address, files, rid) == "refused"

    insider = certs["insider"]
    ctx = attacker.client_context(insider.cert, insider.key, ca)
    compat = attacker.learn_compat(decode.kv_port, ctx)
    sock = attacker.hello(decode.kv_port, compat, ctx)
    try:
        replies = attacker.push(sock, rid, compat)
    finally:
        sock.close()
    assert [(t.name, r) for t, r, _ in replies] == [("ERROR", rid), ("ERROR", rid)], replies
    assert all("bind token" in text and attacker.GUESSED_TOKEN.hex() not in text for _, _, text in replies), replies

    gate.open()
    live.join(timeout=120)
    assert result["text"] == _complete(prefill, PROMPTS[0])  # the live stream's text: as served alone
    stats = get_json(decode.url + "/health")[1]["cachestore"]
    assert stats["tls_refused"] == 3 and stats["binds_refused"] == 2, stats  # 3 strangers; the insider's BIND, DATA
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings
    key = open(certs["servers"].key).read().splitlines()
    secret = [line for line in key if line and not line.startswith("-----")]
    for path in (tmp_path / "logs").glob("*.log"):  # the servers' logs: refusals named, no key material
        text = path.read_text(errors="replace")
        assert not any(line in text for line in secret), path
    assert "refused a connection from 127.0.0.1" in (tmp_path / "logs" / "decode.log").read_text()


def test_tls_on_serves_the_same_text_as_off(procs, certs):
    texts = {}
    for mode, files in (("off", None), ("on", certs["servers"])):
        decode, prefill = _cluster(procs, files)
        texts[mode] = [_complete(prefill, p) for p in PROMPTS]
        readings = wait_all_released([prefill, decode])
        assert nothing_held(readings), (mode, readings)
        procs.kill(prefill.proc), procs.kill(decode.proc)
    assert texts["on"] == texts["off"]
