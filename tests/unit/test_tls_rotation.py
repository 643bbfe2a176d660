"""Mutual TLS in-process, over real sockets (pdserve/tls.py, cachestore/tls_sockets.py): the flags'
errors, KV over TLS on both transports (NIXL's control channel is the TLS one), and certificate
rotation: files replaced on disk, a new connection uses the new certificate while an open stream
(a CacheStore link mid-request, a gRPC server stream) finishes on its old session.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os

import grpc
import pytest

from harness.cachestore_pair import COMPAT, LAYOUT, TRANSPORTS, L, pool, run
from harness.conditions import until
from pdserve import tls, tls_certs
from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender, MemoryRegion, TransferError
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc


def _replace(files: tls.TlsFiles, issued: tls_certs.Issued, ca: tls_certs.Issued) -> None:
    """Rotate: new files written beside, then renamed over the old ones (as a Secret update swaps them)."""
    for path, data in ((files.cert, issued.cert), (files.key, issued.key), (files.ca, ca.cert)):
        with open(path + ".new", "wb") as f:
            f.write(data)
        os.replace(path + ".new", path)


def test_flags_all_or_none_and_errors_name_the_file(tmp_path):
    parser = argparse.ArgumentParser()
    tls.add_arguments(parser)
    assert tls.from_args(parser.parse_args([]), "x") is None
    with pytest.raises(SystemExit, match="missing --tls-key, --tls-ca"):
        tls.from_args(parser.parse_args(["--tls-cert", "c.pem"]), "pdserve decode")
    ca = tls_certs.make_ca()
    files = tls_certs.write(str(tmp_path), "n", tls_certs.issue(ca, "n"), ca)
    args = parser.parse_args(["--tls-cert", files.cert, "--tls-key", str(tmp_path / "nope.key"), "--tls-ca", files.ca])
    with pytest.raises(SystemExit, match=r"pdserve decode: --tls-key .*nope.key: No such file"):
        tls.from_args(args, "pdserve decode")
    other = tls_certs.write(str(tmp_path / "o"), "o", tls_certs.issue(ca, "o"), ca)  # a key of another certificate
    args = parser.parse_args(["--tls-cert", files.cert, "--tls-key", other.key, "--tls-ca", files.ca])
    with pytest.raises(SystemExit) as info:
        tls.from_args(args, "pdserve decode")
    assert "cannot be used together" in str(info.value) and "PRIVATE" not in str(info.value)
    # a half-written replacement keeps the last good certificate in use
    good = tls.from_args(parser.parse_args(["--tls-cert", files.cert, "--tls-key", files.key, "--tls-ca", files.ca]),
                         "x")
    before = good.server_context()
    with open(files.cert, "wb") as f:
        f.write(b"-----BEGIN CERTIFICATE-----\ntruncat")
    assert good.server_context() is before


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kv_over_tls_and_a_rotation_mid_request(tmp_path, transport):
    """A request's link is open (layer 0 delivered) when both sides' files are replaced by a new CA's:
    the request finishes on that link; a new sender with the old CA's files is refused, one with the
    new CA's is served."""
    old_ca, new_ca = tls_certs.make_ca("old"), tls_certs.make_ca("new")
    rx_files = tls_certs.write(str(tmp_path / "rx"), "rx", tls_certs.issue(old_ca, "rx"), old_ca)
    tx_files = tls_certs.write(str(tmp_path / "tx"), "tx", tls_certs.issue(old_ca, "tx"), old_ca)
    src, dst = pool(True), pool(False)

    async def main():
        rx = CacheStoreReceiver(MemoryRegion.from_tensor(dst), LAYOUT, COMPAT, transport=transport, tls=rx_files)
        tx = CacheStoreSender(MemoryRegion.from_tensor(src), LAYOUT, COMPAT, transport=transport, tls=tx_files)
        late_old = CacheStoreSender(MemoryRegion.from_tensor(src), LAYOUT, COMPAT, transport=transport,
                                    tls=tls_certs.write(str(tmp_path / "o"), "o", tls_certs.issue(old_ca, "o"), old_ca))
        late_new = CacheStoreSender(MemoryRegion.from_tensor(src), LAYOUT, COMPAT, transport=transport,
                                    tls=tls_certs.write(str(tmp_path / "n"), "n", tls_certs.issue(new_ca, "n"), new_ca))
        for side in (rx, tx, late_old, late_new):
            await side.start()
        try:
            tx.bind("long", rx.endpoint, rx.expect("long", [1, 2], 30))
            tx.store("long", 0, [3, 4])
            await rx.load("long", 0, 10)
            _replace(rx_files, tls_certs.issue(new_ca, "rx2"), new_ca)
            _replace(tx_files, tls_certs.issue(new_ca, "tx2"), new_ca)
            for layer in range(1, L):  # the open link goes on with its old session
                tx.store("long", layer, [3, 4])
            await tx.wait_sent("long", 10), await rx.wait_all("long", 10)
            assert all(bool((dst[l, 1:3] == src[l, 3:5]).all()) for l in range(L))
            late_old.bind("o", rx.endpoint, rx.expect("o", [5], 30))
            late_old.store("o", 0, [5])
            with pytest.raises(TransferError, match="TLS handshake|refused this sender"):
                await late_old.wait_sent("o", 10)  # the receiver shows its new certificate, of a CA it no longer trusts
            late_new.bind("n", rx.endpoint, rx.expect("n", [6], 30))
            for layer in range(L):
                late_new.store("n", layer, [6])
            await late_new.wait_sent("n", 10), await rx.wait_all("n", 10)
            for rid in ("long", "o", "n"):
                rx.delete(rid)
            tx.delete("long"), late_old.delete("o"), late_new.delete("n")
            assert rx.stats()["tls_refused"] == 1
            await until(lambda: rx.stats()["pinned_entries"] == rx.stats()["inflight_transfers"] == 0,
                        "the receiver to hold nothing")
        finally:
            for side in (late_new, late_old, tx):
                await side.stop()
            await rx.stop()
    run(main())


class _Ticker(gpb_grpc.GeneratorServicer):
    """Generate streams one token each time ``step(model)`` is called for its request's model name
    (streams the test keeps open)."""

    def __init__(self):
        self.steps: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)

    def step(self, model: str) -> None:
        self.steps[model].set()

    async def Generate(self, request, context):
        step = self.steps[request.model]
        for token in range(request.max_tokens):
            await step.wait()
            step.clear()
            yield gpb.GenerateResponse(token_ids=[token])


def test_grpc_rotation_keeps_an_open_stream(tmp_path):
    old_ca, new_ca = tls_certs.make_ca("old"), tls_certs.make_ca("new")
    server_files = tls_certs.write(str(tmp_path / "s"), "s", tls_certs.issue(old_ca, "s"), old_ca)
    old_client = tls_certs.write(str(tmp_path / "c"), "c", tls_certs.issue(old_ca, "c"), old_ca)
    new_client = tls_certs.write(str(tmp_path / "c2"), "c", tls_certs.issue(new_ca, "c2"), new_ca)

    async def main():
        ticker = _Ticker()
        server = grpc.aio.server()
        gpb_grpc.add_GeneratorServicer_to_server(ticker, server)
        port = tls.add_port(server, "127.0.0.1:0", server_files)
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            async with tls.aio_channel(address, old_client) as channel:
                stream = gpb_grpc.GeneratorStub(channel).Generate(gpb.GenerateRequest(model="open", max_tokens=3),
                                                                  timeout=30)
                ticker.step("open")
                got = [(await stream.read()).token_ids[0]]
                _replace(server_files, tls_certs.issue(new_ca, "s2"), new_ca)
                async with tls.aio_channel(address, old_client) as stale:  # a new connection, the old CA's files
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await gpb_grpc.GeneratorStub(stale).Generate(gpb.GenerateRequest(model="stale"),
                                                                     timeout=10).read()
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                async with tls.aio_channel(address, new_client) as fresh:  # the new CA's: served
                    ticker.step("fresh")
                    assert [r.token_ids[0] async for r in gpb_grpc.GeneratorStub(fresh).Generate(
                        gpb.GenerateRequest(model="fresh", max_tokens=1), timeout=10)] == [0]
                for _ in range(2):  # the open stream finishes on its old session
                    ticker.step("open")
                    got.append((await stream.read()).token_ids[0])
                assert got == [0, 1, 2]
        finally:
            await server.stop(None)
    run(main())


def test_long_lived_client_channels_follow_a_rotation_and_keep_their_open_streams(tmp_path):
    """The prefill's channel to a decode (LoadReportPoller.channel) and the router's to a prefill (PrefillWatch)
    are made anew after the files rotate to a new CA, so new calls reach a server that now trusts only the new CA;
    the streams open on the old channels finish on their old sessions."""
    from types import SimpleNamespace

    from pdserve.kv_index import PrefixIndex
    from pdserve.prefill_server.load_poller import LoadReportPoller
    from pdserve.router.prefill_watch import PrefillWatch

    old_ca, new_ca = tls_certs.make_ca("old"), tls_certs.make_ca("new")
    server_files = tls_certs.write(str(tmp_path / "s"), "s", tls_certs.issue(old_ca, "s"), old_ca)
    client = tls_certs.write(str(tmp_path / "c"), "c", tls_certs.issue(old_ca, "c"), old_ca)

    async def first(stub, model: str, ticker):
        stream = stub.Generate(gpb.GenerateRequest(model=model, max_tokens=2), timeout=30)
        ticker.step(model)
        assert (await stream.read()).token_ids == [0]
        return stream

    async def main():
        ticker = _Ticker()
        server = grpc.aio.server()
        gpb_grpc.add_GeneratorServicer_to_server(ticker, server)
        address = f"127.0.0.1:{tls.add_port(server, '127.0.0.1:0', server_files)}"
        await server.start()
        poller = LoadReportPoller(None, SimpleNamespace(expiry_s=1.0), close_grace_s=30, tls=client)
        watch = PrefillWatch(address, PrefixIndex(), tls=client)
        try:
            old = poller.channel(address)
            assert poller.channel(address) is old  # unchanged files: the same channel
            streams = [await first(gpb_grpc.GeneratorStub(old), "p", ticker), await first(watch.generator, "r", ticker)]
            _replace(server_files, tls_certs.issue(new_ca, "s2"), new_ca)
            _replace(client, tls_certs.issue(new_ca, "c2"), new_ca)
            fresh = poller.channel(address)
            assert fresh is not old and poller.channel(address) is fresh
            assert watch._renew_if_rotated() and not watch._renew_if_rotated()
            for stub, model in ((gpb_grpc.GeneratorStub(fresh), "p2"), (watch.generator, "r2")):
                ticker.step(model)  # a new connection with the new CA's files: served
                assert [r.token_ids[0] async for r in stub.Generate(gpb.GenerateRequest(model=model, max_tokens=1),
                                                                    timeout=10)] == [0]
            for stream, model in zip(streams, ("p", "r")):  # the open streams finish on their old sessions
                ticker.step(model)
                assert (await stream.read()).token_ids == [1]
        finally:
            await poller.stop()
            await watch.stop(None)
            await server.stop(None)
    run(main())
