"""PrefillNode.generate resuming after a decode failed mid-stream (node.py, "Resume"), with fake
decodes (no sockets, no engine): when no other decode can take the request now (here: the second
decode has not reported its first load yet), the request waits in the admission queue for one,
up to --resume-wait and never past its deadline, instead of ending with decode_failed at once.

A load report arrives once the request waits in the admission queue (``until``), and the waits are
on a queue clock the test moves (``Clock``; ``notify`` makes the waiting request look at it), so
what a message says it waited is exact."""

import asyncio
import time
from dataclasses import replace

import pytest

from harness.conditions import settle, until
from pdserve.defaults import MAX_QUEUED_REQUESTS
from pdserve.engine import SamplingParams
from pdserve.metrics import ServerMetrics
from pdserve.prefill_server.admission_queue import DEADLINE_MARGIN_S, AdmissionQueue
from pdserve.prefill_server.frontend import Frontend, RequestTimedOut
from pdserve.prefill_server.node import DecodeFailed, Delta
from pdserve.prefill_server.picker import DecodeLoad, DecodePicker
from pdserve.prefill_server.session_protocol import Retryable
from pdserve.prefill_server.wiring import build_node
from pdserve.protos import session_pb2 as pb

PROMPT = [256, 1, 2, 3, 4, 5]
MAX_TOKENS = 10
FAIL_AFTER = 3  # tokens decode A streams before it fails
KB = 1024
LOAD = DecodeLoad(free_blocks=100, free_bytes=100 * KB, total_blocks=100)


HANG_GUARD_S = 20.0  # only a hang guard


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


class Clock:
    """The admission queue's clock, moved by the test."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def token(position: int) -> int:
    """The token a (greedy) decode produces at output position ``position``: any decode, same token."""
    return 1000 + position


class FakeEngine:
    num_blocks = 64

    def num_free_blocks(self) -> int:
        return 64


class FakePoller:
    """What the node uses of the LoadReportPoller; ``report`` is a load report arriving."""

    def __init__(self, picker: DecodePicker, on_report=None):
        self.picker = picker
        self.on_report = on_report

    def stub(self, address):
        raise AssertionError("the fake session runner opens no stream")

    def poll_now(self, address) -> None:
        pass

    def report(self, address: str) -> None:
        self.picker.update(address, DecodeLoad(LOAD.free_blocks, LOAD.free_bytes, LOAD.total_blocks))
        if self.on_report is not None:
            self.on_report(address)


class FakeRunner:
    """Stands in for SessionRunner.run: every decode streams the tokens after those already produced
    (the resumed prompt's tail). Decode A fails mid-stream after FAIL_AFTER tokens the first time;
    after that it is unreachable (``dies``: killed) or serves again (a transient failure)."""

    def __init__(self, dies: bool = True):
        self.dies = dies
        self.failed = False
        self.calls: list[tuple[str, int]] = []  # (decode, tokens already produced)

    def needs_line(self, sp) -> bool:
        return False  # no engine here: every decode computes its prompt (as with --disaggregation never)

    async def run(self, address, session_id, ids, sp, timings, deadline, on_allocated=None, slo_class=None,
                  place=None):
        done = len(ids) - len(PROMPT)
        self.calls.append((address, done))
        if address == "A" and self.failed and self.dies:
            raise Retryable(f"decode {address} unreachable")
        timings.allocated = time.monotonic()
        if on_allocated is not None:
            on_allocated()
        for i in range(sp.max_tokens):
            if address == "A" and not self.failed and i == FAIL_AFTER:
                self.failed = True
                raise DecodeFailed(f"decode {address} failed mid-generation: killed")
            await asyncio.sleep(0)
            last = i == sp.max_tokens - 1
            yield Delta([token(done + i)], last, "length" if last else None)


def make_node(resume_wait_s: float, runner: FakeRunner, **kw):
    picker = DecodePicker()
    metrics = ServerMetrics(role="prefill")
    queue = AdmissionQueue(MAX_QUEUED_REQUESTS, on_length=metrics.requests_queued.set)
    poller = FakePoller(picker, on_report=lambda address: queue.notify())
    compat = pb.Compat(dtype="float32", num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, model="tiny",
                       transport="tcp")
    node = build_node(FakeEngine(), None, picker, poller, queue, compat, block_size=16, kv_bytes_per_block=KB,
                      metrics=metrics, resume_wait_s=resume_wait_s, decode_reuse=False, **kw)
    node.deps = replace(node.deps, session_runner=runner)
    poller.report("A")  # only A is known: B has not reported yet
    return node, poller, metrics


def queued_gauge(metrics: ServerMetrics) -> float:
    return metrics.registry.get_sample_value(
        "pdserve_requests_queued", {"role": "prefill", "pool": "default", "inference_service": "local"})


async def collect(node, deadline=None):
    got, finish = [], None
    async for delta in node.generate("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                                     deadline=deadline):
        got += delta.token_ids
        finish = delta.finish_reason or finish
    return got, finish


async def collect_failure(node, deadline=None):
    """``collect`` for a request that must end with DecodeFailed: (its tokens before that, the error)."""
    got = []
    with pytest.raises(DecodeFailed) as info:
        async for delta in node.generate("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                                         deadline=deadline):
            got += delta.token_ids
    return got, info.value


async def waiting_for_a_decode(node) -> None:
    """Until the request, its decode failed, waits in the admission queue for another one."""
    await until(lambda: len(node.queue) == 1, "the request to wait in the admission queue")


def test_resumes_on_a_decode_whose_first_load_report_comes_after_the_failure():
    async def main():
        runner = FakeRunner()
        node, poller, metrics = make_node(10.0, runner)
        seen = {}

        async def b_reports():  # B's first load report, once A failed and the request waits for a decode
            await waiting_for_a_decode(node)
            seen.update(queued=len(node.queue), gauge=queued_gauge(metrics))
            poller.report("B")

        reporting = asyncio.create_task(b_reports())
        result = await collect(node)
        await reporting
        return result, runner, node, metrics, seen

    (got, finish), runner, node, metrics, seen = run(main())
    assert got == [token(i) for i in range(MAX_TOKENS)] and finish == "length"
    assert seen == {"queued": 1, "gauge": 1.0}  # it waited in the admission queue, counted by the gauge
    assert len(node.queue) == 0 and queued_gauge(metrics) == 0
    # A was not asked again: its report is still fresh, but none came after it failed
    assert runner.calls == [("A", 0), ("B", FAIL_AFTER)]


def test_no_decode_in_time_fails_after_the_resume_wait_naming_it():
    async def main():
        runner = FakeRunner()
        node, _, metrics = make_node(0.3, runner)
        node.queue.clock = clock = Clock()
        failing = asyncio.create_task(collect_failure(node))
        await waiting_for_a_decode(node)
        clock.now = 0.29  # not yet: it goes on waiting
        node.queue.notify()
        await settle()
        assert not failing.done() and queued_gauge(metrics) == 1
        clock.now = 0.3
        node.queue.notify()
        return *(await failing), node, metrics, runner

    got, exc, node, metrics, runner = run(main())
    assert got == [token(i) for i in range(FAIL_AFTER)]
    message = str(exc)
    assert message.startswith("decode A failed mid-generation: killed; no decode could take the request"), message
    assert "waited 0.3s for one (--resume-wait 0.3s)" in message, message
    assert "not retrying A" in message, message
    assert len(node.queue) == 0 and queued_gauge(metrics) == 0
    assert runner.calls == [("A", 0)]


def test_resume_wait_zero_fails_at_once_as_before():
    async def main():
        runner = FakeRunner()
        node, _, metrics = make_node(0, runner)
        # the queue's clock stands still: a request that waited there (for the 10 s default, or a
        # recheck) would never end; and the queue's length never changes
        node.queue.clock = Clock()
        lengths, gauge = [], node.queue.on_length
        node.queue.on_length = lambda n: (lengths.append(n), gauge(n))
        _, exc = await collect_failure(node)
        return exc, node, metrics, lengths

    exc, node, metrics, lengths = run(main())
    assert lengths == []  # never in the admission queue: no wait
    assert str(exc) == "decode A failed mid-generation: killed"
    assert len(node.queue) == 0 and queued_gauge(metrics) == 0


def test_the_deadline_ends_the_wait_before_the_resume_wait():
    async def main():
        runner = FakeRunner()
        node, _, _ = make_node(10.0, runner)
        node.queue.clock = clock = Clock()
        failing = asyncio.create_task(collect_failure(node, deadline=0.5))
        await waiting_for_a_decode(node)
        await settle()
        assert not failing.done()
        clock.now = 0.5 - DEADLINE_MARGIN_S  # the queue gives up a little before the deadline, not after 10 s
        node.queue.notify()
        _, exc = await failing
        return exc, node

    exc, node = run(main())
    assert "waited 0.4s for one until the request's deadline" in str(exc), exc
    assert len(node.queue) == 0


def test_the_failed_decode_is_tried_again_once_it_reports_after_the_failure():
    """A transient failure: A fails mid-stream, no other decode exists; A's next load report
    (after the failure) makes it eligible again, and the request resumes there."""

    async def main():
        runner = FakeRunner(dies=False)
        node, poller, _ = make_node(10.0, runner)

        async def a_reports():  # after the failure: the request waits for a decode
            await waiting_for_a_decode(node)
            poller.report("A")

        reporting = asyncio.create_task(a_reports())
        result = await collect(node)
        await reporting
        return result, runner, node

    (got, finish), runner, node = run(main())
    assert got == [token(i) for i in range(MAX_TOKENS)] and finish == "length"
    assert runner.calls == [("A", 0), ("A", FAIL_AFTER)]
    assert len(node.queue) == 0


def test_a_deadline_that_cancels_a_queued_request_names_the_queue():
    """The queue's clock stands still, so its own timer never ends the wait: the Frontend's deadline
    cancels the request in line, and the conductor's cancellation says how long it had waited there."""

    async def main():
        from pdserve.engine.tokenizer import ByteTokenizer

        runner = FakeRunner()
        node, poller, metrics = make_node(10.0, runner)
        node.queue.clock = Clock()
        poller.picker.update("A", DecodeLoad(free_blocks=0, free_bytes=0, total_blocks=100))  # full: wait in line
        tok = ByteTokenizer()
        fe = Frontend(node, tok, SamplingParams, "tiny", 2048, vocab_size=tok.vocab_size)
        with pytest.raises(RequestTimedOut) as info:
            async for _ in fe.stream("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS), timeout_s=0.2):
                pass
        return info.value, node, metrics, runner

    exc, node, metrics, runner = run(main())
    assert "waited 0.0s in the admission queue" in str(exc) and "until its deadline" in str(exc), exc
    assert len(node.queue) == 0 and queued_gauge(metrics) == 0
    assert runner.calls == []  # never tried: the only decode was full
