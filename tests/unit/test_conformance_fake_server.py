"""bench conformance against a tiny fake OpenAI server (in this process): the checks pass where the fake
conforms, and each one fails when the fake breaks exactly what it asserts (a 500 on bad input, a body
that is not an OpenAI error, two [DONE]s, events with different ids, a greedy answer that changes, counters
that never come back, a server that never answers). A fake is fine here: these test the judge, not a
server; tests/e2e/test_bench_conformance.py runs the suite against real pdserve processes."""

import asyncio
import json

from aiohttp import web

from pdserve.bench.conformance import bad_input, cancellation, correctness
from pdserve.bench.conformance.runner import Context
from pdserve.bench.conformance.verdict import FAIL, PASS
from pdserve.bench.conformance.wire import Endpoint

MODEL = "fake"


class FakeServer:
    """/v1/completions (whole and SSE, logprobs, usage) and /metrics; ``mode`` breaks one thing."""

    def __init__(self, mode: str = ""):
        self.mode, self.calls, self.in_flight = mode, 0, 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, request):
        if self.mode == "no-metrics":
            raise web.HTTPNotFound()
        return web.Response(text=f"# TYPE vllm:num_requests_running "
                                 f"gauge\nvllm:num_requests_running {self.in_flight}\n")

    def error(self, message: str, param: str) -> web.Response:
        if self.mode == "500":
            return web.Response(status=500, text="Internal Server Error")
        if self.mode == "not-openai":
            return web.json_response({"detail": message}, status=422)
        return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                            "code": None}}, status=400)

    async def completions(self, request):
        if self.mode == "hang":
            await asyncio.Event().wait()
        try:
            body = json.loads(await request.read())
        except ValueError:
            return self.error("not JSON", None)
        if not isinstance(body, dict):
            return self.error("not an object", None)
        if body.get("model") != MODEL:
            return self.error("unknown or missing model", "model")
        if not isinstance(body.get("prompt"), str):
            return self.error("prompt must be a string", "prompt")
        n = body.get("max_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1000:
            return self.error("max_tokens must be an integer in [1, 1000]", "max_tokens")
        if not isinstance(body.get("stream", False), bool):
            return self.error("stream must be a boolean", "stream")
        if not isinstance(body.get("n", 1), int) or not 1 <= body.get("n", 1) <= 8:
            return self.error("n must be in [1, 8]", "n")
        if not isinstance(body.get("temperature", 1.0), (int, float)) or not 0 <= body.get("temperature", 1.0) <= 2:
            return self.error("temperature must be in [0, 2]", "temperature")
        self.calls += 1
        shift = self.calls if self.mode == "random" else 0
        tokens = [chr(97 + (i * 7 + len(body["prompt"]) + shift) % 26) for i in range(n)]
        want_lp = body.get("logprobs") is not None
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n}

        def lp(ts, start):
            return {"tokens": ts, "token_logprobs": [-0.5] * len(ts), "top_logprobs": [{t: -0.5} for t in ts],
                    "text_offset": list(range(start, start + len(ts)))} if want_lp else None

        head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL}
        if not body.get("stream"):
            return web.json_response({**head,
                                      "choices": [{"index": 0, "text": "".join(tokens), "logprobs": lp(tokens, 0),
                                                           "finish_reason": "length"}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.in_flight += 1
        try:
            for i, t in enumerate(tokens):
                event = {**head, "choices": [{"index": 0, "text": t, "logprobs": lp([t], i), "finish_reason": None}]}
                if self.mode == "mixed-ids" and i == 1:
                    event["id"] = "cmpl-2"
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            await resp.write(
                f"data: {json.dumps({**head, 'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}]})}\n\n"
                .encode())
            if (body.get("stream_options") or {}).get("include_usage"):
                await resp.write(f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n" * (2 if self.mode == "two-done" else 1))
        finally:
            if self.mode != "stuck":  # stuck: a request that is never let go of
                self.in_flight -= 1
        return resp


def run_against(mode: str, check, hang_s: float = 30.0):
    """Start the fake in this event loop, run one check function against it, stop the fake."""
    async def main():
        runner = web.AppRunner(FakeServer(mode).app(), shutdown_timeout=0.1)  # a hanging handler is cancelled
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        ep = Endpoint(f"http://127.0.0.1:{port}", model=MODEL, hang_s=hang_s, total_s=hang_s)
        await ep.open()
        try:
            ctx = Context(ep, lengths=(4, 12), metrics_urls=[ep.url + "/metrics"], options={"cancel_max_tokens": 400})
            return await check(ctx)
        finally:
            await ep.close()
            await runner.cleanup()
    return asyncio.run(main())


def test_the_conforming_fake_passes_the_checks_it_implements():
    for slug in ("missing-model", "negative-max-tokens", "invalid-json", "absurd-n", "string-stream", "unknown-model"):
        out = run_against("", lambda c, s=slug: bad_input.one_case(c, s))
        assert out.verdict == PASS, (slug, out.detail)
    for check in (lambda c: correctness.sse(c, "completions"), lambda c: correctness.greedy(c, "completions"),
                  lambda c: correctness.streamed(c, "completions"),
                  lambda c: cancellation.cancel_stream(c, "completions")):
        out = run_against("", check)
        assert out.verdict == PASS, out.detail


def test_a_500_on_malformed_input_fails():
    out = run_against("500", lambda c: bad_input.one_case(c, "negative-max-tokens"))
    assert out.verdict == FAIL and "HTTP 500, not 4xx" in out.detail


def test_an_error_body_of_another_shape_fails():
    out = run_against("not-openai", lambda c: bad_input.one_case(c, "missing-prompt"))
    assert out.verdict == FAIL and "no 'error' object" in out.detail


def test_a_server_that_never_answers_fails_on_the_hang_guard():
    out = run_against("hang", lambda c: bad_input.one_case(c, "missing-model"), hang_s=0.5)
    assert out.verdict == FAIL and "hang guard" in out.detail


def test_two_done_events_or_mixed_ids_fail_the_sse_check():
    out = run_against("two-done", lambda c: correctness.sse(c, "completions"))
    assert out.verdict == FAIL and "[DONE] came 2 times" in out.detail
    out = run_against("mixed-ids", lambda c: correctness.sse(c, "completions"))
    assert out.verdict == FAIL and "event ids" in out.detail


def test_greedy_answers_that_change_between_requests_fail():
    out = run_against("random", lambda c: correctness.greedy(c, "completions"))
    assert out.verdict == FAIL and "texts differ" in out.detail


def test_in_flight_counters_that_never_come_back_fail_and_missing_ones_are_only_noted():
    out = run_against("stuck", lambda c: cancellation.cancel_stream(c, "completions"), hang_s=1.0)
    assert out.verdict == FAIL and "in-flight counters still" in out.detail
    out = run_against("no-metrics", lambda c: cancellation.cancel_stream(c, "completions"))
    assert out.verdict == PASS and "not checked" in out.detail
