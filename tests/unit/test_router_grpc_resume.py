"""The router's gRPC Generate relay when a prefill goes away mid-stream (router/grpc_api.py, router/relay.py;
the contract is pdserve/stream_resume.py), in process over real gRPC: prefills here are small grpc.aio
servers streaming a script (response k carries token SCRIPT[k], ``completion_tokens`` k + 1, as a prefill
writes them; a request with ``resume_token_ids`` goes on after them), their loads set by hand.

- prefill A's server stops after k responses (what a drained or killed prefill's client sees: UNAVAILABLE),
  once the client holds those k (a server stopped at once resets its connections, and responses still in
  the router's socket are lost: the router would rightly resume from fewer, but the test names k); the
  router resumes the stream on B with the tokens the client has and the stream's request id. At every
  cut the client's responses equal the uninterrupted stream's: no token twice or missing, one request id,
  ``completion_tokens`` 1..N, one finish. A cut after the finish response needs no resume;
- a resume B refuses, and a B that ignores ``resume_token_ids`` (it starts over), end the call with A's
  status and why it was not resumed; nothing of such a B reaches the client;
- a prefill's own verdict mid-stream (ABORTED: its decode failed) is relayed, not resumed; a prefill that
  goes away before its first response (UNAVAILABLE, or UNKNOWN / INTERNAL as a reset connection ends a
  call) is skipped for the next one (the request goes whole);
- afterwards the relay counts and every prefill's in-flight count are zero.
"""

import asyncio

import grpc
import pytest

from harness.router_fakes import counter, grpc_router_over, set_load
from pdserve.net import free_ports
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc

SCRIPT = list(b"every token once")
N = len(SCRIPT)
REQUEST = gpb.GenerateRequest(prompt="go", max_tokens=N, temperature=0.0)


def script(request_id: str, start: int = 0) -> list[gpb.GenerateResponse]:
    """The stream as a prefill writes it, from token ``start`` on."""
    out = [gpb.GenerateResponse(request_id=request_id, token_ids=[t], text=chr(t), prompt_tokens=3,
                                completion_tokens=k + 1) for k, t in enumerate(SCRIPT) if k >= start]
    return out + [gpb.GenerateResponse(request_id=request_id, finish_reason="length", prompt_tokens=3,
                                       completion_tokens=N)]


class Delivery:
    """Responses the fakes wrote (``sent``) and the client read (``received``); a fake that stops its server
    first waits until the client holds everything it wrote (``all_received``)."""

    def __init__(self):
        self.sent = self.received = 0
        self._changed = asyncio.Event()

    def receive(self):
        self.received += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def all_received(self):
        while self.received < self.sent:
            await self._changed.wait()


class ScriptGenerator(gpb_grpc.GeneratorServicer):
    """Streams SCRIPT (after a request's ``resume_token_ids``, under its request id or one of its own). ``die``:
    responses after which its server stops (its calls end UNAVAILABLE); ``verdict``: a status it ends the call
    with after ``die`` responses instead; ``ignore_resume``: it starts over whatever the request says (a
    prefill that does not know the field)."""

    def __init__(self, port: int, die: int | None = None, verdict=None, ignore_resume: bool = False):
        self.port, self.die, self.verdict, self.ignore_resume = port, die, verdict, ignore_resume
        self.requests: list[gpb.GenerateRequest] = []
        self.server = None
        self.delivery: Delivery | None = None  # set by _run

    async def Generate(self, request, context):
        self.requests.append(request)
        rid = request.request_id or f"id-{self.port}"
        responses = script(rid, 0 if self.ignore_resume else len(request.resume_token_ids))
        for k in range(len(responses) + 1):  # (its end too: after its finish response, before the call's status)
            if k == self.die:
                await self.delivery.all_received()
                if self.verdict is not None:
                    await context.abort(self.verdict, f"the prefill's own verdict: {self.verdict.name}")
                asyncio.get_running_loop().create_task(self.server.stop(None))  # as a drained prefill's shutdown
                await asyncio.Event().wait()  # cancelled by the stop
            if k < len(responses):
                self.delivery.sent += 1
                yield responses[k]


async def _generate(address: str, delivery: Delivery) -> tuple[list[gpb.GenerateResponse],
                                                             grpc.aio.AioRpcError | None]:
    got = []
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            async for response in gpb_grpc.GeneratorStub(channel).Generate(REQUEST, timeout=30):
                got.append(response)
                delivery.receive()
        except grpc.aio.AioRpcError as exc:
            return got, exc
    return got, None


def _run(a: ScriptGenerator, b: ScriptGenerator, scenario, prefill_wait_s: float = 5.0):
    """The router over A and B; A ranks first (B reports load). After the scenario nothing is in flight."""

    async def main():
        a.delivery = b.delivery = Delivery()
        async with grpc_router_over({"a": a, "b": b}, prefill_wait_s) as (router, servicer, address):
            set_load(a.watch, a.port)
            set_load(b.watch, b.port, in_flight=3)
            result = await scenario(address, servicer)
            assert servicer.in_flight == 0 and a.watch.in_flight == 0 and b.watch.in_flight == 0
            return result

    return asyncio.run(main())


@pytest.mark.parametrize("die", [1, 5, N - 1, N, N + 1])  # after k token responses, all tokens, the finish
def test_a_stream_whose_prefill_goes_away_is_resumed_on_another(die):
    a, b = (ScriptGenerator(p) for p in free_ports(2))
    a.die = die

    async def scenario(address, servicer):
        got, error = await _generate(address, a.delivery)
        assert error is None, error
        assert got == script(f"id-{a.port}")  # the uninterrupted stream, once, under A's request id
        if die > N:  # the finish went out: nothing was left to resume
            assert b.requests == [] and counter(servicer, "pdserve_router_resumes_total") == 0
            return
        (resumed,) = b.requests
        assert list(resumed.resume_token_ids) == SCRIPT[:die] and resumed.request_id == f"id-{a.port}"
        rest = gpb.GenerateRequest()
        rest.CopyFrom(resumed)
        rest.ClearField("resume_token_ids")
        rest.request_id = ""
        assert rest == REQUEST  # otherwise the client's own request
        assert counter(servicer, "pdserve_router_resumes_total", outcome="resumed") == 1
        assert counter(servicer, "pdserve_requests_total", outcome="ok", reason="resumed") == 1
        assert counter(servicer, "pdserve_router_decisions_total", reason="resume") == 1

    _run(a, b, scenario)


@pytest.mark.parametrize("b_kind", ["refuses", "ignores the resume"])
def test_a_resume_no_prefill_can_continue_ends_with_the_status_and_why(b_kind):
    a, b = free_ports(2)
    a = ScriptGenerator(a, die=3)
    b = (ScriptGenerator(b, die=0, verdict=grpc.StatusCode.INVALID_ARGUMENT) if b_kind == "refuses"
         else ScriptGenerator(b, ignore_resume=True))

    async def scenario(address, servicer):
        got, error = await _generate(address, a.delivery)
        assert got == script(f"id-{a.port}")[:3]  # nothing of B reached the client
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
        assert f"prefill 127.0.0.1:{a.port} failed mid-stream" in error.details()
        why = "INVALID_ARGUMENT: the prefill's own verdict" if b_kind == "refuses" else "does not continue the stream"
        assert "not resumed" in error.details() and why in error.details(), error.details()
        assert counter(servicer, "pdserve_router_resumes_total", outcome="failed") == 1
        assert counter(servicer, "pdserve_requests_total", outcome="error", reason="prefill_failed") == 1

    _run(a, b, scenario, prefill_wait_s=0.2)  # then no prefill is left to try: the wait for one


def test_a_prefills_own_verdict_mid_stream_is_relayed_not_resumed():
    a, b = free_ports(2)
    a, b = ScriptGenerator(a, die=4, verdict=grpc.StatusCode.ABORTED), ScriptGenerator(b)

    async def scenario(address, servicer):
        got, error = await _generate(address, a.delivery)
        assert got == script(f"id-{a.port}")[:4] and error.code() == grpc.StatusCode.ABORTED
        assert error.details() == "the prefill's own verdict: ABORTED" and b.requests == []
        assert counter(servicer, "pdserve_router_resumes_total") == 0
        assert counter(servicer, "pdserve_requests_total", outcome="error", reason="grpc_aborted") == 1

    _run(a, b, scenario)


@pytest.mark.parametrize("how", ["stopped", "UNKNOWN", "INTERNAL"])  # UNKNOWN "Stream removed": a reset connection
def test_a_prefill_that_goes_away_before_its_first_response_is_skipped(how):
    a, b = free_ports(2)
    verdict = None if how == "stopped" else grpc.StatusCode[how]
    a, b = ScriptGenerator(a, die=0, verdict=verdict), ScriptGenerator(b)

    async def scenario(address, servicer):
        got, error = await _generate(address, a.delivery)
        assert error is None and got == script(f"id-{b.port}")
        assert len(a.requests) == 1 and b.requests == [REQUEST]  # the request whole, no resume
        assert counter(servicer, "pdserve_router_decisions_total", reason="retry") == 1
        assert counter(servicer, "pdserve_router_resumes_total") == 0

    _run(a, b, scenario)
