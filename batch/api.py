"""The OpenAI Batch API on the prefill's HTTP port: files, batches, and the runner behind them.

| route                              | answer                                                      |
|------------------------------------|-------------------------------------------------------------|
| POST /v1/files                     | multipart ``file`` (JSONL) + ``purpose=batch`` -> the file object |
| GET  /v1/files/{id}                | the file object (DELETE: deletes it)                         |
| GET  /v1/files?purpose=&limit=&after= | newest first, ``limit`` 1-10000 (10000)                    |
| GET  /v1/files/{id}/content        | the file's bytes (inputs, and the output/error files of batches) |
| POST /v1/batches                   | ``{input_file_id, endpoint, completion_window: "24h", metadata?}`` -> the batch (validating) |
| GET  /v1/batches/{id}              | the batch: status, ``request_counts``, output/error file ids  |
| GET  /v1/batches?limit=&after=     | newest first, ``limit`` 1-100 (20), ``after`` a batch id      |
| POST /v1/batches/{id}/cancel       | -> cancelling, then cancelled                                 |

Errors are OpenAI error bodies: 400 for a request that cannot be taken (no multipart, a
purpose other than batch, a file over ``--batch-max-file-bytes``, not JSONL, an unknown
input file, an endpoint other than /v1/chat/completions or /v1/completions, a window other
than 24h), 404 for an unknown id, 409 for cancelling a finished batch, 503 when the Batch
API is off (``--batch-db ''``) or its database could not be opened (the reason is given).

The jobs of a prefill live in its own database (``--batch-db``): ask the prefill that took
a batch for its status and files. Through ``pdserve router`` these paths are not relayed
(docs/batch.md says why).
"""  # noqa: E501

from __future__ import annotations

import logging
import os
import time
from functools import partial

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

import pdserve.prefill_server.openai_api as oa
from pdserve import defaults

from .lines import COMPLETION_WINDOWS, BatchInputError, check_batch_params, check_upload
from .runner import BatchRunner, StoreThread, execute
from .store import BatchStore

log = logging.getLogger(__name__)
CHUNK = 1 << 16


def _error(status: int, message: str, code: str | None = None, param: str | None = None,
           type_: str = "invalid_request_error") -> web.Response:
    return web.json_response(oa.error_body(message, type_, param, code), status=status)


class BatchService:
    """The store (in its thread), the runner and the routes; ``unavailable`` says why not, when off."""

    def __init__(self, store: StoreThread | None, runner: BatchRunner | None, max_file_bytes: int,
                 unavailable: str | None = None, clock=time.time):
        self.store, self.runner, self.max_file_bytes = store, runner, max_file_bytes
        self.unavailable, self.clock = unavailable, clock

    @classmethod
    def start(cls, args, frontend) -> BatchService:
        """From the flags: open the database, pick the SLO class, start the runner (resuming jobs)."""
        slo_class = None  # flags checked by cli.run: --batch-slo-class names a declared class
        if frontend.slo is not None:
            classes = frontend.slo.classes
            slo_class = classes.by_name.get(args.batch_slo_class or defaults.BATCH_SLO_CLASS, classes.default)
        if not args.batch_db:
            return cls(None, None, args.batch_max_file_bytes, "the Batch API is off on this server (--batch-db '')")
        path = os.path.expanduser(args.batch_db)
        try:
            store = StoreThread(BatchStore(path))
        except Exception as exc:  # StoreInUse, OSError, sqlite3.Error: serve online traffic anyway
            log.warning("Batch API off: %s", exc)
            return cls(None, None, args.batch_max_file_bytes, f"the Batch API is off on this server: {exc}")
        runner = BatchRunner(store, partial(execute, frontend, slo_class), args.batch_max_in_flight)
        runner.start()
        log.info("Batch API: database %s, %d line(s) in flight at most, SLO class %s", path, args.batch_max_in_flight,
                 slo_class.name if slo_class else "(none)")
        return cls(store, runner, args.batch_max_file_bytes)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self.store is not None:
            self.store.close()

    def state(self) -> dict:
        return {"on": self.runner is not None, **(self.runner.state() if self.runner else {"reason": self.unavailable})}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.files)
        app.router.add_get("/v1/files/{id}", self.file)
        app.router.add_delete("/v1/files/{id}", self.delete_file)
        app.router.add_get("/v1/files/{id}/content", self.content)
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list)
        app.router.add_get("/v1/batches/{id}", self.batch)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel)

    def _off(self) -> web.Response | None:
        return None if self.store is not None else _error(503, self.unavailable, "batch_api_off", type_="server_error")

    async def upload(self, request: web.Request) -> web.Response:
        if off := self._off():
            return off
        if not request.content_type.startswith("multipart/form-data"):
            return _error(400, f"POST /v1/files takes multipart/form-data with the fields 'file' and 'purpose', got "
                               f"{request.content_type or 'no content type'}", "invalid_content_type")
        purpose, filename, content, size = None, None, bytearray(), 0
        try:
            async for part in await request.multipart():
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file":
                    filename = part.filename or "upload.jsonl"
                    while chunk := await part.read_chunk(CHUNK):
                        size += len(chunk)  # read to the end (the client is still sending), keep at most the limit
                        if size <= self.max_file_bytes:
                            content += chunk
                else:
                    await part.release()
        except (ValueError, AssertionError, HttpProcessingError) as exc:  # aiohttp's complaints about the framing
            return _error(400, f"malformed multipart body: {str(exc)[:200] or type(exc).__name__}", "invalid_multipart")
        if purpose != "batch":
            return _error(400, f"purpose must be 'batch' (the only purpose this server serves), got {purpose!r}",
                          "invalid_purpose", "purpose")
        if filename is None:
            return _error(400, "missing the multipart field 'file'", "missing_required_parameter", "file")
        try:
            if size > self.max_file_bytes:
                _too_large(size, self.max_file_bytes)
            check_upload(bytes(content), self.max_file_bytes)
        except BatchInputError as exc:
            return _error(400, exc.message, exc.code, exc.param)
        return web.json_response(await self.store("add_file", purpose, filename, bytes(content), int(self.clock())))

    async def file(self, request: web.Request) -> web.Response:
        if off := self._off():
            return off
        obj = await self.store("file", request.match_info["id"])
        return web.json_response(obj) if obj else _not_found("file", request.match_info["id"])

    async def delete_file(self, request: web.Request) -> web.Response:
        if off := self._off():
            return off
        fid = request.match_info["id"]
        if not await self.store("delete_file", fid):
            return _not_found("file", fid)
        return web.json_response({"id": fid, "object": "file", "deleted": True})

    async def files(self, request: web.Request) -> web.Response:
        if off := self._off():
            return off
        limit = _limit(request, 10000, 10000)
        if isinstance(limit, web.Response):
            return limit
        try:
            page, more = await self.store("list_files", limit, request.query.get("after"), request.query.get("purpose"))
        except KeyError:
            return _error(400, f"after: no file {request.query.get('after')[:64]!r}", "invalid_after", "after")
        return _page(page, more)

    async def content(self, request: web.Request) -> web.Response:
        if off := self._off():
            return off
        data = await self.store("file_content", request.match_info["id"])
        if data is None:
            return _not_found("file", request.match_info["id"])
        return web.Response(body=data, content_type="application/jsonl")

    async def create(self, request: web.Request) -> web.Response:
        if off := self._off():
            return off
        try:
            body = oa.parse_json(await request.read())
            file_id, endpoint, window, metadata = check_batch_params(body)
        except oa.BadRequest as exc:
            return _error(400, exc.message, exc.code, exc.param)
        except BatchInputError as exc:
            return _error(400, exc.message, exc.code, exc.param)
        f = await self.store("file", file_id)
        if f is None or f["purpose"] != "batch":
            why = "no such file" if f is None else f"its purpose is {f['purpose']}, not batch"
            return _error(400, f"input_file_id {file_id[:64]!r}: {why}", "invalid_input_file", "input_file_id")
        now = int(self.clock())
        batch = await self.store("create_batch", file_id, endpoint, window, metadata, now,
                                 now + COMPLETION_WINDOWS[window])
        self.runner.wake()
        log.info("batch %s created from %s (%s)", batch["id"], file_id, endpoint)
        return web.json_response(batch)

    async def batch(self, request: web.Request) -> web.Response:
        if off := self._off():
            return off
        obj = await self.store("batch", request.match_info["id"])
        return web.json_response(obj) if obj else _not_found("batch", request.match_info["id"])

    async def list(self, request: web.Request) -> web.Response:
        if off := self._off():
            return off
        limit = _limit(request, 20, 100)
        if isinstance(limit, web.Response):
            return limit
        try:
            page, more = await self.store("list_batches", limit, request.query.get("after"))
        except KeyError:
            return _error(400, f"after: no batch {request.query.get('after')[:64]!r}", "invalid_after", "after")
        return _page(page, more)

    async def cancel(self, request: web.Request) -> web.Response:
        if off := self._off():
            return off
        bid = request.match_info["id"]
        try:
            obj = await self.store("cancel", bid, int(self.clock()))
        except KeyError:
            return _not_found("batch", bid)
        except ValueError as exc:
            return _error(409, str(exc), "batch_not_cancellable")
        self.runner.wake()
        return web.json_response(obj)


def _limit(request: web.Request, default: int, most: int) -> int | web.Response:
    try:
        limit = int(request.query.get("limit", str(default)))
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        return _error(400, f"limit must be an integer in [1, {most}], got {request.query.get('limit')!r}",
                      "invalid_limit", "limit")
    return limit


def _page(page: list[dict], more: bool) -> web.Response:
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": more})


def _too_large(size: int, limit: int):
    raise BatchInputError(f"file is {size} bytes, larger than this server's limit of {limit} bytes "
                          f"(--batch-max-file-bytes)", "file_too_large", "file")


def _not_found(kind: str, ident: str) -> web.Response:
    return _error(404, f"no {kind} {ident[:64]!r} on this server", f"{kind}_not_found", type_="not_found_error")

