"""PrefillTokenizer (``pdserve router --tokenizer-from-prefill``) against small aiohttp prefills whose loads are
set by hand: a prefill of an older pdserve (404, no /tokenizer) is retried and the reason shows in why_not(),
a good answer loads the real tokenizer, and no answering prefill ends in one line after ``wait_s``
(the real processes: tests/e2e/test_router_tokenizer_from_prefill.py)."""

import asyncio
import json
import time

import pytest
from aiohttp import web

from harness.conditions import until
from pdserve import tokenizer_files
from pdserve.discovery import StaticDiscovery
from pdserve.net import free_ports
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.kv_index import PrefixIndex
from pdserve.router.prefill_tokenizer import PrefillTokenizer, TokenizerUnavailable
from pdserve.router.prefill_watch import PrefillWatch
from pdserve.router.prefills import PrefillSet


def write_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


async def serve_tokenizer(port: int, answer) -> web.AppRunner:
    """A prefill's HTTP port with GET /tokenizer answering ``answer()`` (a web.Response)."""
    async def tokenizer(request: web.Request) -> web.Response:
        return answer()

    app = web.Application()
    app.router.add_get(tokenizer_files.ROUTE, tokenizer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def watched(address: str, http_port: int | None) -> PrefillSet:
    """A PrefillSet naming ``address``, its load answered (with ``http_port``) or not (None); nothing polled."""
    prefills = PrefillSet(StaticDiscovery([address]), PrefixIndex())
    watch = prefills.watches[address] = PrefillWatch(address, prefills.index)
    if http_port is not None:
        watch.load = kpb.ServerLoad(ready=True, http_port=http_port, block_size=16)
        watch.load_at = time.monotonic()
    return prefills


def test_an_older_prefill_is_retried_and_a_good_answer_loads_the_tokenizer(tmp_path):
    http, grpc = free_ports(2)
    doc = tokenizer_files.pack(str(write_tokenizer(tmp_path)))
    old = {"on": True}

    async def scenario():
        runner = await serve_tokenizer(http, lambda: web.Response(status=404, text="404: Not Found") if old["on"]
                                       else web.json_response(doc))
        prefills = watched(f"127.0.0.1:{grpc}", http)
        source = PrefillTokenizer(prefills, wait_s=30.0, retry_s=0.05)
        loading = asyncio.ensure_future(source.load())
        try:
            await until(lambda: source.last_failure, "the first answer (a 404) recorded as a failure")
            assert "no /tokenizer there (a pdserve older than this router?)" in source.why_not()
            assert source.state()["loaded"] is False and not loading.done()
            old["on"] = False  # the prefill is upgraded: its next answer is the files
            tokenizer = await asyncio.wait_for(loading, 30.0)
        finally:
            await runner.cleanup()
            await prefills.stop()
        return tokenizer, source

    tokenizer, source = asyncio.run(scenario())
    assert tokenizer.encode("hello world") == [2, 3] and tokenizer.eos_token_ids == [1]
    assert source.state() == {"from": "prefill", "loaded": True, "prefill": f"127.0.0.1:{grpc}",
                              "files": ["tokenizer.json", "tokenizer_config.json"]}


def test_no_answering_prefill_ends_in_one_line_after_the_wait():
    async def scenario():
        prefills = watched("127.0.0.1:9", None)
        source = PrefillTokenizer(prefills, wait_s=0.3, retry_s=0.05)
        assert source.why_not().endswith("127.0.0.1:9 named by discovery, none answers yet")
        try:
            await source.load()
        finally:
            await prefills.stop()

    with pytest.raises(TokenizerUnavailable, match=r"no prefill gave its tokenizer within 0.3s \(--tokenizer-wait\): "
                                                   r"waiting for a prefill .* 127.0.0.1:9 named by discovery"):
        asyncio.run(scenario())
