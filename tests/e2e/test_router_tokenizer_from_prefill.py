"""A router with no copy of the model (`pdserve router --tokenizer-from-prefill`, what the operator runs when
the model is on a claim) takes the tokenizer files from a prefill (GET /tokenizer), with real processes:

- a prefill serving a Hugging Face directory (word-level tokenizer) sends fetch-model --tokenizer-only's
  files, byte for byte, and nothing else (no weights, no README); the router loads them and tokenizes a
  prompt as the prefill does: the same count as the prefill's usage, and after one request its index
  holds the prompt's blocks (the block hashes of the same ids);
- a router started before any prefill answers serves its probes, says why it is not ready (discovery
  names none; then one that does not answer), and once a prefill (built-in model) answers, loads the
  byte-level tokenizer and becomes ready;
- a router that no prefill answers exits with status 1 after --tokenizer-wait, naming what it waited for.

Afterwards nothing is held: KV blocks, Sessions, CacheStore entries, relays in flight.
"""

import base64
import socket

import pytest

from harness.conditions import wait_until
from harness.hf_hub_server import write_tiny_checkpoint
from harness.pd_cluster import (Server, get_json, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from pdserve.engine.tokenizer import HFTokenizer
from pdserve.net import free_port

pytestmark = pytest.mark.slow

HANG_GUARD_S = 60.0  # only a hang guard: each wait below takes well under a second on an idle box
BS = 4
TEXT = " ".join(["the cat sat on a mat"] * 4)  # 24 words: 24 ids of the checkpoint's word-level tokenizer
TOKENIZER_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def start_router(procs, *args: str) -> Server:
    port = free_port()
    proc = procs.pdserve("router", "--port", str(port), "--tokenizer-from-prefill", "--load-interval", "0.1",
                         "--discovery-interval", "0.1", *args, name="router")
    return Server(proc, port, 0, 0, "router")


def not_ready_reason(router: Server) -> str | None:
    """The router's /ready reason while it answers 503 (None before it listens)."""
    try:
        status, doc = get_json(router.url + "/ready", timeout=1.0)
    except OSError:
        return None
    assert status == 503, doc
    return doc["reason"]


def route_preview(router: Server, prompt: str) -> dict:
    status, doc = post_json(router.url + "/debug/route?kind=completion", {"model": "m", "prompt": prompt})
    assert status == 200, doc
    return doc


def assert_nothing_held(router: Server, servers: list[Server]) -> None:
    readings = wait_all_released(servers, timeout=HANG_GUARD_S)
    assert nothing_held(readings), readings
    health = get_json(router.url + "/health")[1]
    assert health["in_flight"] == 0 and all(p["in_flight_here"] == 0 for p in health["prefills"].values())


def test_a_router_without_the_model_tokenizes_as_the_prefill_with_its_files(procs, tmp_path):
    model = write_tiny_checkpoint(tmp_path / "model")  # also model.safetensors and a README.md: never sent
    extra = ["--model", str(model), "--block-size", str(BS)]
    decode = start_decode(procs, extra=extra)
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], extra=extra)
    wait_ready(prefill)

    status, doc = get_json(prefill.url + "/tokenizer")
    assert status == 200 and doc["version"] == 1 and doc["model"] == str(model)
    assert sorted(doc["files"]) == TOKENIZER_FILES
    for name, data in doc["files"].items():
        assert base64.b64decode(data) == (model / name).read_bytes()

    router = start_router(procs, "--prefill", prefill.grpc_address)
    wait_ready(router)
    health = get_json(router.url + "/health")[1]
    assert health["tokenizer"] == {"from": "prefill", "loaded": True, "prefill": prefill.grpc_address,
                                   "files": TOKENIZER_FILES}
    log = (tmp_path / "logs" / "router.log").read_text()
    assert f"tokenizer from prefill {prefill.grpc_address} ({prefill.url}, model {model}): " in log
    assert ", ".join(TOKENIZER_FILES) in log

    ids = HFTokenizer(model).encode(TEXT)  # the prefill's tokenizer, read here from the folder itself
    assert len(ids) == 24  # (the byte-level tokenizer would count 1 + len(TEXT) = 96)
    assert route_preview(router, TEXT)["prompt_tokens"] == len(ids)
    status, answer = post_json(router.url + "/v1/completions",
                               {"model": str(model), "prompt": TEXT, "max_tokens": 2, "temperature": 0})
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == len(ids)
    # vLLM's /tokenize and /detokenize, relayed to a prefill: its tokenizer's ids and text
    status, counted = post_json(router.url + "/tokenize", {"model": str(model), "prompt": TEXT})
    assert status == 200 and counted["tokens"] == ids and counted["count"] == len(ids), counted
    assert post_json(router.url + "/detokenize", {"tokens": ids}) == (200, {"prompt": TEXT})
    status, err = post_json(router.url + "/detokenize", {"tokens": [10**6]})
    assert status == 400 and err["error"]["param"] == "tokens", err
    # the prefill's KV events name the blocks of the ids it computed; the router's hashes of its own ids match them
    reusable = (len(ids) - 1) // BS
    wait_until(lambda: route_preview(router, TEXT)["cached_blocks"] == reusable,
               "the router's index holding the prompt's blocks", HANG_GUARD_S)
    assert_nothing_held(router, [prefill, decode])


def test_a_router_waits_for_a_prefill_then_takes_the_built_in_tokenizer(procs, tmp_path):
    listing = tmp_path / "prefills"
    listing.write_text("")
    decode = start_decode(procs)
    router = start_router(procs, "--discovery", "file", "--prefill-file", str(listing))
    wait_until(lambda: (r := not_ready_reason(router)) is not None and "discovery names none yet" in r,
               "the router saying discovery names no prefill", HANG_GUARD_S)
    assert not_ready_reason(router).startswith("no tokenizer yet: waiting for a prefill to take the tokenizer from")
    dead = f"127.0.0.1:{free_port()}"  # named, but nothing listens there
    listing.write_text(dead + "\n")
    wait_until(lambda: f"{dead} named by discovery, none answers yet" in (not_ready_reason(router) or ""),
               "the router saying the named prefill does not answer", HANG_GUARD_S)

    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address])  # the built-in model: no tokenizer files
    wait_ready(prefill)
    assert not_ready_reason(router)  # still waiting: discovery does not name the prefill yet
    listing.write_text(prefill.grpc_address + "\n")
    wait_ready(router)
    assert get_json(router.url + "/health")[1]["tokenizer"] == {
        "from": "prefill", "loaded": True, "prefill": prefill.grpc_address, "files": []}
    assert "no files: the built-in byte tokenizer" in (tmp_path / "logs" / "router.log").read_text()
    assert route_preview(router, "hello")["prompt_tokens"] == 1 + len("hello")  # BOS + one id per byte
    status, answer = post_json(router.url + "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert status == 200 and answer["usage"]["prompt_tokens"] == 6, answer
    assert_nothing_held(router, [prefill, decode])


def test_a_router_that_no_prefill_answers_exits_after_its_tokenizer_wait(procs, tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    router = start_router(procs, "--prefill", dead, "--tokenizer-wait", "3")
    wait_until(lambda: router.proc.poll() is not None or "none answers yet" in (not_ready_reason(router) or ""),
               "the router saying no prefill answers", HANG_GUARD_S)
    assert router.proc.wait(timeout=HANG_GUARD_S) == 1
    log = (tmp_path / "logs" / "router.log").read_text()
    assert (f"no prefill gave its tokenizer within 3s (--tokenizer-wait): waiting for a prefill to take the "
            f"tokenizer from: {dead} named by discovery, none answers yet") in log
    assert "Traceback" not in log
    # it holds nothing any more: its port is free again
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", router.http_port)) != 0
