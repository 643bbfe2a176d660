"""The API key file (pdserve/api_keys.py): its format, its errors (one line naming the file and line, never
the key), the derived name of an unnamed key, and matching in constant time; and the door's checks
(pdserve/http_auth.py) on an in-process aiohttp app: which paths stay open, the 401's body, the counts by
key name. The real doors with the real openai client: tests/e2e/test_api_keys_doors.py."""

import asyncio
import hashlib

import aiohttp
import pytest
from aiohttp import web

from pdserve import api_keys
from pdserve.http_auth import Door
from pdserve.metrics import ServerMetrics
from pdserve.net import free_port

SECRET = "sk-test-5a1e0c3b9d"
OTHER = "sk-other-77f2a0"


def test_named_unnamed_comments_and_blank_lines():
    text = f"# the team's keys\n\n  alice:{SECRET}  \n{OTHER}\n   # indented comment\nbob:a#b:c\n"
    keys = api_keys.parse(text, "keys.txt")
    assert [k.name for k in keys] == ["alice", "key-" + hashlib.sha256(OTHER.encode()).hexdigest()[:8], "bob"]
    assert [k.secret for k in keys] == [SECRET.encode(), OTHER.encode(), b"a#b:c"]  # split at the first ':'
    assert SECRET not in repr(keys)  # a key is never shown, not even in a repr


@pytest.mark.parametrize("text, message", [
    ("", "keys.txt: no keys in the file"),
    ("# only a comment\n\n", "keys.txt: no keys in the file"),
    (f"alice:{SECRET}\nalice:{OTHER}\n", "keys.txt, line 2: the name 'alice' is already on line 1"),
    (f"{SECRET}\nbob:{SECRET}\n", "keys.txt, line 2: the same key as line 1"),
    (f"bad name:{SECRET}\n", "keys.txt, line 1: the name before ':' must match"),
    ("alice:\n", "keys.txt, line 1: a key must be printable ASCII without spaces"),
    (f"alice:{SECRET} {OTHER}\n", "keys.txt, line 1: a key must be printable ASCII without spaces"),
    ("alice:sk-\u00e9t\u00e9\n", "keys.txt, line 1: a key must be printable ASCII"),
])
def test_errors_name_the_file_and_line_never_the_key(text, message):
    with pytest.raises(api_keys.KeyFileError) as err:
        api_keys.parse(text, "keys.txt")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert SECRET not in str(err.value) and OTHER not in str(err.value)


def test_an_unreadable_file_is_named(tmp_path):
    with pytest.raises(api_keys.KeyFileError, match=f"^{tmp_path}/absent: cannot read the key file: No such file"):
        api_keys.load(tmp_path / "absent")
    with pytest.raises(api_keys.KeyFileError, match="cannot read the key file: Is a directory"):
        api_keys.load(tmp_path)


def test_match_compares_every_key():
    keys = api_keys.ApiKeys(api_keys.parse(f"alice:{SECRET}\nbob:{OTHER}\n", "k"))
    assert keys.match(SECRET).name == "alice" and keys.match(OTHER).name == "bob"
    for wrong in ("", SECRET[:-1], SECRET + "x", SECRET.upper(), "sk-\u00e9"):
        assert keys.match(wrong) is None
    assert keys.first() == SECRET.encode()


async def _serve(door: Door, port: int) -> web.AppRunner:
    async def ok(request):
        return web.json_response({"ok": True})

    app = web.Application()
    for path in ("/health", "/ready", "/metrics", "/v1/models", "/v1/batches"):
        app.router.add_get(path, ok)
    door.install(app)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _statuses(door: Door, requests: list[tuple[str, str | None]]) -> list[tuple[int, dict]]:
    port = free_port()
    runner = await _serve(door, port)
    out = []
    try:
        async with aiohttp.ClientSession() as session:
            for path, auth in requests:
                headers = {"Authorization": auth} if auth is not None else {}
                async with session.get(f"http://127.0.0.1:{port}{path}", headers=headers) as resp:
                    out.append((resp.status, await resp.json(), resp.headers.get("WWW-Authenticate")))
    finally:
        await runner.cleanup()
    return out


def test_the_door_lets_in_a_key_and_counts_it_by_name():
    metrics = ServerMetrics("prefill")
    door = Door(api_keys.ApiKeys(api_keys.parse(f"alice:{SECRET}\n", "k")), metrics=metrics)
    got = asyncio.run(_statuses(door, [
        ("/health", None), ("/ready", None), ("/metrics", None),  # open
        ("/v1/models", None), ("/v1/models", f"Bearer {OTHER}"), ("/v1/models", SECRET),  # no scheme: missing
        ("/v1/models", f"Basic {SECRET}"), ("/v1/batches", f"bearer {SECRET}"), ("/nowhere", None),
    ]))
    assert [status for status, _, _ in got] == [200, 200, 200, 401, 401, 401, 401, 200, 401]
    refused = got[3][1]["error"]
    assert refused["code"] == "invalid_api_key" and refused["type"] == "invalid_request_error"
    assert "Authorization: Bearer" in refused["message"] and got[3][2] == "Bearer"
    assert got[4][1]["error"]["message"] == "the API key is not one of this server's keys"
    body = metrics.render()[0].decode()
    assert 'pdserve_api_key_requests_total{api_key="alice"' in body
    assert metrics.api_key_requests.labels(api_key="alice")._value.get() == 1
    assert metrics.api_key_refusals.labels(reason="missing")._value.get() == 4
    assert metrics.api_key_refusals.labels(reason="invalid")._value.get() == 1
    assert SECRET not in body and OTHER not in body


def test_metrics_behind_their_own_key():
    door = Door(None, api_keys.ApiKeys(api_keys.parse(f"scraper:{OTHER}\n", "k")))
    got = asyncio.run(_statuses(door, [("/metrics", None), ("/metrics", f"Bearer {SECRET}"),
                                       ("/metrics", f"Bearer {OTHER}"), ("/v1/models", None), ("/health", None)]))
    assert [status for status, _, _ in got] == [401, 401, 200, 200, 200]


def test_no_keys_no_middleware():
    app = web.Application()
    Door(None).install(app)
    assert not app.middlewares


def test_an_unusable_file_ends_the_process_with_one_line(tmp_path):
    import argparse

    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n")
    with pytest.raises(SystemExit) as err:
        Door.from_args(argparse.Namespace(api_key_file=str(empty), metrics_key_file=None), "pdserve prefill")
    assert str(err.value) == f"pdserve prefill: {empty}: no keys in the file (one key a line; blank lines and # " \
                             "comments are ignored)"
