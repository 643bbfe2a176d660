"""pdserve.bench.loadgen against a small aiohttp streaming server started by the test (unit test of
the generator itself; the end-to-end run against a real `pdserve up` is in test_loadgen_cluster.py)."""

import asyncio
import json
import subprocess

import pytest
from aiohttp import web

from pdserve.bench.loadgen import LoadConfig, send_requests
from pdserve.bench.loadgen_workload import RequestSpec
from pdserve.net import free_port
from harness.procs import VENV_BIN
from harness.threaded_app import ThreadedApp

TTFT, GAP = 0.05, 0.01


class FakeOpenAI(ThreadedApp):
    """Streams max_tokens one-token chunks: first after TTFT, then every GAP seconds."""

    def __init__(self):
        self.bodies = []
        self.in_flight = self.max_in_flight = 0
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        super().__init__(app)

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        if "bad" in str(body.get("prompt", "")):
            return web.json_response({"error": {"message": "prompt is bad", "type": "invalid_request_error"}},
                                     status=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(TTFT)
            n = body["max_tokens"]
            for i in range(n):
                if "die" in str(body.get("prompt", "")) and i == 1:
                    await resp.write(b'data: {"error": {"message": "decode failed"}}\n\n')
                    return resp
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if i < n - 1:
                    await asyncio.sleep(GAP)
            usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            return resp
        finally:
            self.in_flight -= 1

    async def chat(self, request):
        """Chat chunks as the prefill server sends them: a role-only first delta, then content."""
        body = await request.json()
        self.bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(head)}\n\n".encode())
        await asyncio.sleep(TTFT)
        n = body["max_tokens"]
        for i in range(n):
            chunk = {"choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(GAP)
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        await resp.write(f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode())
        return resp


@pytest.fixture
def fake():
    with FakeOpenAI() as server:
        yield server


def test_streaming_times_ttft_and_gaps(fake):
    config = LoadConfig(url=f"http://127.0.0.1:{fake.port}", progress=False)
    specs = [RequestSpec(3, 5, prompt="a b c"), RequestSpec(2, 3, prompt="d e")]
    results, wall = asyncio.run(send_requests(config, specs, arrivals=[0.0, 0.1]))
    assert all(r.ok for r in results), [r.error for r in results]
    r0, r1 = results
    assert r0.chunks == 5 and len(r0.gaps) == 4 and r0.usage_completion_tokens == 5
    assert r0.usage_prompt_tokens == 3
    # Only what the fake server guarantees: it sleeps TTFT before the first chunk and GAP between
    # chunks after the client sent the request, so nothing the client measures can be shorter. How
    # much longer depends on the box (a busy event loop reads two chunks at once: a gap near 0).
    assert r0.ttft >= TTFT  # from the request's send to the first token chunk, not to the headers
    assert all(g >= 0 for g in r0.gaps)
    assert r0.e2e >= TTFT + 4 * GAP  # to the last chunk, not the first
    assert r0.e2e >= r0.ttft + sum(r0.gaps) - 1e-6  # the gaps lie between the first and last token
    assert r1.sent_at >= 0.1 - 0.005
    assert wall >= r1.sent_at + r1.e2e - 1e-3
    body = fake.bodies[0]
    assert body["stream"] is True and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["model"] == "tiny" and body["prompt"] == "a b c"


def test_chat_api_counts_content_chunks_only(fake):
    config = LoadConfig(url=f"http://127.0.0.1:{fake.port}", api="chat", progress=False)
    results, _ = asyncio.run(send_requests(config, [RequestSpec(2, 4, prompt="hi there")], concurrency=1))
    r = results[0]
    assert r.ok and r.chunks == 4 and len(r.gaps) == 3
    assert r.ttft >= TTFT  # the role-only chunk before the sleep is not the first token
    assert fake.bodies[0]["messages"] == [{"role": "user", "content": "hi there"}]
    with pytest.raises(ValueError, match="token-id prompts"):
        config.payload(RequestSpec(2, 1, prompt_ids=(1, 2)))


def test_concurrency_is_bounded(fake):
    config = LoadConfig(url=f"http://127.0.0.1:{fake.port}", progress=False)
    specs = [RequestSpec(2, 4, prompt="x y") for _ in range(9)]
    results, _ = asyncio.run(send_requests(config, specs, concurrency=3))
    assert all(r.ok for r in results)
    assert fake.max_in_flight == 3


def test_errors_are_recorded_not_raised(fake):
    config = LoadConfig(url=f"http://127.0.0.1:{fake.port}", progress=False)
    specs = [RequestSpec(1, 4, prompt="bad"), RequestSpec(1, 4, prompt="die"), RequestSpec(1, 2, prompt="ok")]
    results, _ = asyncio.run(send_requests(config, specs, concurrency=3))
    assert results[0].status == 400 and "prompt is bad" in results[0].error and not results[0].ok
    assert results[1].error == "stream error: decode failed" and not results[1].ok
    assert results[2].ok
    # nothing listens on this port: a connection error, recorded
    dead = LoadConfig(url=f"http://127.0.0.1:{free_port()}", progress=False)
    results, _ = asyncio.run(send_requests(dead, [RequestSpec(1, 1, prompt="x")], concurrency=1))
    assert not results[0].ok and results[0].error


def test_config_is_validated():
    with pytest.raises(ValueError, match="api"):
        LoadConfig(api="embeddings")
    with pytest.raises(ValueError, match="url"):
        LoadConfig(url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="either"):
        asyncio.run(send_requests(LoadConfig(progress=False), [], arrivals=None, concurrency=None))


def test_cli_writes_json_and_png(fake, tmp_path):
    out = tmp_path / "res"
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "serving", "--url", f"http://127.0.0.1:{fake.port}",
                           "--num-requests", "12", "--request-rate", "40", "--prompt-len", "8", "--output-len", "4",
                           "--max-output-len", "8", "--warmup", "1", "--slo-ttft-ms", "1000", "--slo-tbt-ms", "1000",
                           "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TTFT" in proc.stdout and "goodput" in proc.stdout
    doc = json.loads((out / "serving.json").read_text())
    s = doc["summary"]
    assert s["requests"] == 12 and s["succeeded"] == 12 and s["goodput"] > 0
    assert s["ttft_s"]["p50"] >= TTFT
    assert len(doc["requests"]) == 12
    assert (out / "serving.png").read_bytes()[:4] == b"\x89PNG"
    assert len(fake.bodies) == 13  # 12 measured + 1 warm-up


def test_cli_bad_input_is_a_clear_error(tmp_path):
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "serving", "--dataset", "jsonl", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--dataset-path" in proc.stderr
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "serving", "--num-requests", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--num-requests must be >= 1" in proc.stderr
