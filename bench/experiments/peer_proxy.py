"""The small proxy in front of vLLM's own P/D (a prefill and a decode vLLM joined by NixlConnector).

For each ``POST /v1/completions`` (or ``/v1/chat/completions``):

1. send the request to the prefill vLLM with ``max_tokens: 1``, ``stream: false`` and
   ``kv_transfer_params: {"do_remote_decode": true}`` (vLLM keeps the prompt's KV blocks
   for a remote reader and answers with the ``kv_transfer_params`` that locate them);
2. send the client's request unchanged to the decode vLLM with those ``kv_transfer_params``
   (its NixlConnector reads the blocks from prefill), and stream the decode's answer back.

Both requests carry the same ``X-Request-Id``. A prefill error goes back to the client as it
came. This is the role of vLLM's example proxy (``toy_proxy_server.py``), written here on
aiohttp. Run: ``python -m pdserve.bench.experiments.peer_proxy --port P --prefill URL --decode URL``.
"""

from __future__ import annotations

import argparse
import uuid

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(body: dict) -> dict:
    """The request for the prefill instance: one token, no stream, keep the KV for a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(REMOTE_DECODE))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def make_app(prefill: str, decode: str) -> web.Application:
    app = web.Application(client_max_size=64 << 20)

    async def start(app_: web.Application) -> None:
        app_["http"] = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None))

    async def stop(app_: web.Application) -> None:
        await app_["http"].close()

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        http: ClientSession = request.app["http"]
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or uuid.uuid4().hex}
        async with http.post(prefill + request.path, json=prefill_body(body), headers=headers) as r:
            answer = await r.read()
            if r.status != 200:
                return web.Response(status=r.status, body=answer, content_type=r.content_type)
            params = (await r.json()).get("kv_transfer_params")
        async with http.post(decode + request.path, json={**body, "kv_transfer_params": params}, headers=headers) as r:
            if r.status != 200 or not body.get("stream"):
                return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
            resp = web.StreamResponse(status=200, headers={"Content-Type": r.headers.get("Content-Type",
                                                                                         "text/event-stream")})
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def passthrough(request: web.Request) -> web.Response:
        async with request.app["http"].get(decode + request.path) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", passthrough)
    app.router.add_get("/health", passthrough)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="base URL of the prefill vLLM")
    parser.add_argument("--decode", required=True, help="base URL of the decode vLLM")
    args = parser.parse_args(argv)
    web.run_app(make_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host, port=args.port,
                print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
