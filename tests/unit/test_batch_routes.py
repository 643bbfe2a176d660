"""The Batch API's HTTP routes (pdserve.batch.api.BatchService) over a real store, without a model: the
400s that name the problem, 404s, 409, and 503 when the Batch API is off."""

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.batch.api import BatchService
from pdserve.batch.runner import StoreThread
from pdserve.batch.store import BatchStore

LINE = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                   "body": {"model": "tiny", "prompt": "x"}})


class Runner:
    woken = 0

    def wake(self):
        self.woken += 1


def run(tmp_path, check, off: str | None = None):
    async def main():
        store = None if off else StoreThread(BatchStore(str(tmp_path / "b.sqlite")))
        service = BatchService(store, None if off else Runner(), max_file_bytes=1000, unavailable=off, clock=lambda: 7)
        app = web.Application()
        service.add_routes(app)
        async with TestClient(TestServer(app)) as client:
            await check(client, service)
        if store:
            store.close()

    asyncio.run(asyncio.wait_for(main(), 20))


def _form(content: bytes, purpose="batch", name="in.jsonl") -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", content, filename=name, content_type="application/jsonl")
    return form


async def _err(resp, status):
    assert resp.status == status, await resp.text()
    return (await resp.json())["error"]


def test_upload_errors_name_the_problem(tmp_path):
    async def check(client, service):
        e = await _err(await client.post("/v1/files", json={"file": "x"}), 400)
        assert e["code"] == "invalid_content_type" and "multipart/form-data" in e["message"]
        e = await _err(await client.post("/v1/files", data=b"--x\r\nbroken", headers={
            "Content-Type": "multipart/form-data; boundary=x"}), 400)
        assert e["code"] == "invalid_multipart"
        e = await _err(await client.post("/v1/files", data=_form(LINE.encode() * 40)), 400)
        assert e["code"] == "file_too_large" and "1000 bytes" in e["message"]
        e = await _err(await client.post("/v1/files", data=_form(b"a,b\n")), 400)
        assert e["code"] == "invalid_file_format" and "not JSONL" in e["message"]
        e = await _err(await client.post("/v1/files", data=_form(LINE.encode(), purpose="assistants")), 400)
        assert e["param"] == "purpose"
        form = aiohttp.FormData(default_to_multipart=True)
        form.add_field("purpose", "batch")
        e = await _err(await client.post("/v1/files", data=form), 400)
        assert e["param"] == "file"

    run(tmp_path, check)


def test_files_batches_list_and_cancel(tmp_path):
    async def check(client, service):
        resp = await client.post("/v1/files", data=_form((LINE + "\n").encode()))
        f = await resp.json()
        assert resp.status == 200 and f["purpose"] == "batch" and f["filename"] == "in.jsonl" and f["created_at"] == 7
        assert (await (await client.get(f"/v1/files/{f['id']}/content")).read()) == (LINE + "\n").encode()
        assert (await (await client.get(f"/v1/files/{f['id']}")).json()) == f
        await _err(await client.get("/v1/files/file-nope"), 404)
        other = await (await client.post("/v1/files", data=_form((LINE + "\n").encode(), name="two.jsonl"))).json()
        listed = await (await client.get("/v1/files?limit=1")).json()
        assert [x["id"] for x in listed["data"]] == [other["id"]] and listed["has_more"]
        listed = await (await client.get(f"/v1/files?after={other['id']}&purpose=batch")).json()
        assert [x["id"] for x in listed["data"]] == [f["id"]] and not listed["has_more"]
        assert (await (await client.get("/v1/files?purpose=batch_output")).json())["data"] == []
        assert (await _err(await client.get("/v1/files?limit=10001"), 400))["param"] == "limit"
        assert (await (await client.delete(f"/v1/files/{other['id']}")).json())["deleted"] is True
        await _err(await client.delete(f"/v1/files/{other['id']}"), 404)
        e = await _err(await client.post("/v1/batches", data=b"{nope"), 400)
        assert e["code"] == "invalid_json"
        e = await _err(await client.post("/v1/batches",
                                         json={"input_file_id": "file-nope", "endpoint": "/v1/completions",
                                                                "completion_window": "24h"}), 400)
        assert e["param"] == "input_file_id" and "no such file" in e["message"]
        resp = await client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                      "completion_window": "24h"})
        b = await resp.json()
        assert resp.status == 200 and b["status"] == "validating" and b["expires_at"] == 7 + 24 * 3600
        assert service.runner.woken == 1
        for query in ("limit=0", "limit=101", "limit=x"):
            assert (await _err(await client.get(f"/v1/batches?{query}"), 400))["param"] == "limit"
        assert (await _err(await client.get("/v1/batches?after=batch_nope"), 400))["param"] == "after"
        listed = await (await client.get("/v1/batches")).json()
        assert [x["id"] for x in listed["data"]] == [b["id"]] and listed["first_id"] == listed["last_id"] == b["id"]
        assert not listed["has_more"]
        cancelled = await (await client.post(f"/v1/batches/{b['id']}/cancel")).json()
        assert cancelled["status"] == "cancelling" and service.runner.woken == 2
        await _err(await client.post("/v1/batches/batch_nope/cancel"), 404)
        await _err(await client.get("/v1/batches/batch_nope"), 404)

    run(tmp_path, check)


def test_off_answers_503_with_the_reason(tmp_path):
    async def check(client, service):
        for method, path in (("post", "/v1/files"), ("get", "/v1/batches"), ("get", "/v1/batches/b"),
                             ("post", "/v1/batches"), ("get", "/v1/files/f/content")):
            e = await _err(await getattr(client, method)(path), 503)
            assert e["code"] == "batch_api_off" and "in use by another process" in e["message"]
        assert service.state() == {"on": False, "reason": service.unavailable}

    run(tmp_path, check, off="the Batch API is off on this server: batch database x is in use by another process")
