"""The extra hop's own cost: one more loopback HTTP exchange of the same body, with a server that does nothing.

A request through the router crosses loopback twice more than one sent straight to a prefill (the body to
the prefill, its answer back). ``serve`` is the least server that can answer it: an asyncio protocol on
uvloop (the router's loop) that reads the request line, the headers and ``Content-Length`` bytes of body and
answers at once with one SSE event and ``[DONE]`` (keep-alive). ``hop_window`` runs it on the router's CPU at
the router's priority and sends it the bench's bodies at the windows' rate through the bench's own client
(``client.send_all``): the time to its first byte, per request, is a whole loopback HTTP exchange of an
~80 KB body (the client's aiohttp both ways included), so an upper bound on what the hop itself costs.

Run ``python -m pdserve.bench.router_scale.hop PORT``.
"""

from __future__ import annotations

import asyncio
import sys

ANSWER = b"data: {}\n\ndata: [DONE]\n\n"
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: "
            + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)


class Answer(asyncio.Protocol):
    """HTTP/1.1 with Content-Length bodies, keep-alive: every request answered with ``RESPONSE``."""

    def connection_made(self, transport) -> None:
        self.transport, self.buf, self.need = transport, b"", -1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need < 0:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head, self.buf = self.buf[:end].lower(), self.buf[end + 4:]
                at = head.find(b"content-length:")
                self.need = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buf) < self.need:
                return
            self.buf, self.need = self.buf[self.need:], -1
            self.transport.write(RESPONSE)


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Answer, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def hop_window(setup, bodies: list[bytes], arrivals: list[float]) -> dict:
    """The bodies sent at their arrivals to ``serve`` on the router's CPU (``setup``'s launcher, CPUs and
    priority): the exchange's time to first byte, as ``client.summary`` gives it."""
    import time

    from pdserve.net import free_port

    from .client import send_all, summary

    port = free_port()
    proc = setup.launcher.spawn(f"hop-{setup.count}", [*setup._nice(), sys.executable, "-m",
                                                       "pdserve.bench.router_scale.hop", str(port)],
                                cpus=setup.router_cpus)
    try:
        setup.launcher.wait_ready(proc, f"http://127.0.0.1:{port}/", timeout=60)
        t0 = time.monotonic()
        results = asyncio.run(send_all([f"http://127.0.0.1:{port}"], bodies, arrivals))
        return summary(results, time.monotonic() - t0)
    finally:
        setup.launcher.stop(proc)


if __name__ == "__main__":
    import uvloop

    uvloop.run(serve(int(sys.argv[1])))
