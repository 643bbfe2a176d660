"""API keys on every OpenAI door, with the real ``openai`` client against real processes: a decode, a prefill
(with its Batch API) and ``pdserve router`` in front of it, and ``pdserve batch-server``, the three doors
started with the same ``--api-key-file`` (one named key, one unnamed) on free ports.

- a missing key (the client told to omit its Authorization header; a plain request without it) and a wrong
  key get 401 with the OpenAI
  error body (``invalid_api_key``) on every door and every kind of route (chat, completions, models,
  files, batches), as ``openai.AuthenticationError``;
- a right key is served on every door: chat (whole and streamed through the router, which forwards the
  client's key to the prefill), completions, models, and a batch job from upload to output on both Batch
  APIs;
- /health, /ready and /metrics answer without a key;
- the per-key counter moves by the requests each key made, under the key's name (the unnamed key's
  derived name), and refusals by reason; the scrape holds no key;
- a router that takes its tokenizer from a prefill (--tokenizer-from-prefill) does so with its own key;
- after wrong and right keys, no server's log (DEBUG) holds either key;
- an unreadable or empty key file ends each server (and ``pdserve up``) at start with one line naming it.
"""

import json
import subprocess
import urllib.error
import urllib.request

import pytest
from openai import AuthenticationError, Omit, OpenAI

from harness.conditions import wait_until
from harness.pd_cluster import Server, metric, start_decode, start_prefill, wait_ready
from harness.procs import VENV_BIN, ProcessGroup
from harness.router_cluster import start_router
from pdserve.api_keys import derived_name
from pdserve.net import free_port

pytestmark = pytest.mark.slow

ALICE = "sk-alice-0b8e61f2c4d94a7e"  # named "alice" in the key file
UNNAMED = "sk-unnamed-93d1c07a5be2"  # counted under derived_name(UNNAMED)
WRONG = "sk-wrong-6f4a2d19e0c7b3"
CHAT = "/v1/chat/completions"
LOUD = ("--log-level", "DEBUG")  # everything the servers log, so that a key in any line would be seen
HANG_GUARD_S = 120.0  # a batch job on the shared CPU takes seconds; only a hang guard


@pytest.fixture(scope="module")
def doors(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doors")
    keys = tmp / "api-keys"
    keys.write_text(f"# the test's keys\nalice:{ALICE}\n\n{UNNAMED}\n")
    door = ("--api-key-file", str(keys))
    group = ProcessGroup(log_dir=tmp / "logs")
    try:
        decode = start_decode(group, num_blocks=64)
        prefill = start_prefill(group, [decode.grpc_address], extra=[
            *door, *LOUD, "--batch-db", str(tmp / "prefill.sqlite"), "--load-report-interval", "0.1"])
        router = start_router(group, [prefill], extra=[*door, *LOUD])
        port = free_port()
        batch = Server(group.pdserve("batch-server", "--port", str(port), "--batch-db", str(tmp / "batch.sqlite"),
                                     "--model", "tiny", "--pipeline-stages", "2", "--num-blocks", "64",
                                     "--max-num-seqs", "4", *door, *LOUD, name="batch-server"), port, 0, 0,
                       "batch-server")
        for server in (decode, prefill, router, batch):
            wait_ready(server)
        yield {"prefill": prefill, "router": router, "batch": batch, "logs": tmp / "logs", "group": group,
               "tmp": tmp}
    finally:
        group.close()


def client(server: Server, key: str) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def chat(c: OpenAI, text: str = "hello", **kw):
    return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=4,
                                     temperature=0, **kw)


def calls(door: str):
    """(what, call) of the routes a door serves, each taking a client and the request's extra headers."""
    online = [("chat", lambda c, h: chat(c, extra_headers=h)),
              ("completions", lambda c, h: c.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                                               extra_headers=h)),
              ("models", lambda c, h: c.models.list(extra_headers=h))]
    batch = [("files", lambda c, h: c.files.list(extra_headers=h)),
             ("batches", lambda c, h: c.batches.list(extra_headers=h)),
             ("upload", lambda c, h: c.files.create(file=("in.jsonl", b"{}\n"), purpose="batch", extra_headers=h))]
    return {"router": online, "prefill": online + batch, "batch": batch}[door]


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("door", ["router", "prefill", "batch"])
def test_a_missing_or_wrong_key_gets_401_on_every_route(doors, door):
    server = doors[door]
    # no key: the client told to send no Authorization header (it refuses to start without a key of its own)
    for key, headers in ((WRONG, None), (WRONG, {"Authorization": Omit()})):
        for what, call in calls(door):
            with pytest.raises(AuthenticationError) as err:
                call(client(server, key), headers)
            assert err.value.status_code == 401, (door, what, headers)
            assert err.value.code == "invalid_api_key" and err.value.type == "invalid_request_error", err.value.body
            assert WRONG not in str(err.value)
    status, body = get(server.url + "/v1/models")  # no Authorization header at all
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def test_a_right_key_is_served_on_every_door(doors):
    router, prefill = doors["router"], doors["prefill"]
    for server, key in ((router, ALICE), (prefill, UNNAMED), (router, UNNAMED)):
        c = client(server, key)
        answer = chat(c)
        assert answer.choices[0].message.content and answer.usage.completion_tokens == 4
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chat(c, stream=True) if ch.choices)
        assert streamed == answer.choices[0].message.content  # greedy: the same text, streamed
        assert c.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None
        assert [m.id for m in c.models.list()] == ["tiny"]
    for door in ("prefill", "batch"):  # both Batch APIs, upload to output
        c = client(doors[door], ALICE)
        line = {"custom_id": "a", "method": "POST", "url": CHAT,
                "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}
        file_id = c.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch").id
        batch_id = c.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id
        done = wait_until(lambda: (b := c.batches.retrieve(batch_id)).status in ("completed", "failed") and b,
                          f"the {door}'s batch job ended", hang_guard_s=HANG_GUARD_S)
        assert done.status == "completed" and done.request_counts.completed == 1, done
        (out,) = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
        assert out["custom_id"] == "a" and out["response"]["status_code"] == 200


@pytest.mark.parametrize("door", ["router", "prefill", "batch"])
def test_probes_and_metrics_stay_open(doors, door):
    for path in ("/health", "/ready") + (("/metrics",) if door != "batch" else ()):
        status, _ = get(doors[door].url + path)
        assert status == 200, (door, path)


def test_requests_are_counted_per_key_name(doors):
    router, prefill = doors["router"], doors["prefill"]
    name = "pdserve_api_key_requests_total"
    refused = "pdserve_api_key_refusals_total"
    unnamed = derived_name(UNNAMED)
    before = {(s.name, k): metric(s.url, name, api_key=k) for s in (router, prefill) for k in ("alice", unnamed)}
    refusals = {r: metric(router.url, refused, reason=r) for r in ("missing", "invalid")}
    for _ in range(3):
        chat(client(router, ALICE))
    chat(client(router, UNNAMED))
    for key, headers in ((WRONG, {"Authorization": Omit()}), (WRONG, None), (WRONG, None)):
        with pytest.raises(AuthenticationError):
            chat(client(router, key), extra_headers=headers)
    # the router counted each request under its key's name; its prefill counted the relayed ones too
    for server in (router, prefill):
        assert metric(server.url, name, api_key="alice") == before[(server.name, "alice")] + 3
        assert metric(server.url, name, api_key=unnamed) == before[(server.name, unnamed)] + 1
    assert metric(router.url, refused, reason="missing") == refusals["missing"] + 1
    assert metric(router.url, refused, reason="invalid") == refusals["invalid"] + 2
    for server in (router, prefill):
        scrape = get(server.url + "/metrics")[1].decode()
        assert ALICE not in scrape and UNNAMED not in scrape and WRONG not in scrape


def test_a_router_takes_its_tokenizer_from_a_prefill_behind_keys(doors, procs, tmp_path):
    """The operator's router for a model on a claim: --tokenizer-from-prefill asks GET /tokenizer with its own
    first key (without one the prefill answers 401 and the router would never be ready)."""
    assert get(doors["prefill"].url + "/tokenizer")[0] == 401
    port = free_port()
    proc = procs.pdserve("router", "--port", str(port), "--tokenizer-from-prefill", "--prefill",
                         doors["prefill"].grpc_address, "--load-interval", "0.1",
                         "--api-key-file", str(doors["tmp"] / "api-keys"), name="router-tokenizer")
    router = Server(proc, port, 0, 0, "router-tokenizer")
    wait_ready(router)
    assert chat(client(router, UNNAMED)).usage.completion_tokens == 4
    log = (tmp_path / "logs" / "router-tokenizer.log").read_text(errors="replace")  # the procs fixture's logs
    assert "tokenizer from prefill" in log and ALICE not in log and UNNAMED not in log


def test_no_key_in_any_log(doors):
    for door in ("router", "prefill", "batch"):  # a wrong and a right key on every door, then the logs
        with pytest.raises(AuthenticationError):
            client(doors[door], WRONG).files.list() if door == "batch" else chat(client(doors[door], WRONG))
        client(doors[door], ALICE).files.list() if door == "batch" else chat(client(doors[door], ALICE))
    logs = {p.name: p.read_text(errors="replace") for p in doors["logs"].glob("*.log")}
    assert {"router.log", "prefill.log", "batch-server.log", "decode.log"} <= set(logs)
    assert f"2 API key(s) (alice, {derived_name(UNNAMED)})" in logs["router.log"]  # the names are logged, no key
    for name, text in logs.items():
        for key in (ALICE, UNNAMED, WRONG):
            assert key not in text, f"{name} holds a key"


@pytest.mark.parametrize("command", [
    ["prefill", "--decode", "127.0.0.1:1"], ["router", "--prefill", "127.0.0.1:1"],
    ["batch-server", "--batch-db", "{tmp}/db.sqlite"], ["up"]])
def test_an_unusable_key_file_ends_the_server_at_start_with_one_line(tmp_path, command):
    empty = tmp_path / "empty-keys"
    empty.write_text("# no keys yet\n\n")
    for path, why in ((tmp_path / "absent", "cannot read the key file: No such file or directory"),
                      (empty, "no keys in the file")):
        argv = [str(VENV_BIN / "pdserve"), *(a.format(tmp=tmp_path) for a in command), "--api-key-file", str(path)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 1 and lines == [f"pdserve {command[0]}: {path}: {why}" + (
            " (one key a line; blank lines and # comments are ignored)" if path == empty else "")], done.stderr
