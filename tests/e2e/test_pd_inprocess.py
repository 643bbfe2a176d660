"""Both ends of the Session stream in one process (fast, no subprocesses): a real gRPC
decode service with a real engine and CacheStore receiver, and a PrefillNode with its own
engine and CacheStore sender. Checks the state machines: tokens equal the colocated
engine's, a request larger than the decode's pool is RequestTooLarge naming the sizes, closing the
client's stream cancels on decode, and everything is freed on both ends afterwards."""

import asyncio
import threading

import grpc
import pytest
import torch

from harness.conditions import settle, until

from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender
from pdserve.decode_server.wiring import build_service
from pdserve.discovery import StaticDiscovery
from pdserve.engine import AsyncLLMEngine, EngineConfig, LLMEngine, OutOfBlocksError, SamplingParams, load_model
from pdserve.defaults import MAX_QUEUED_REQUESTS
from pdserve.prefill_server.admission_queue import AdmissionQueue
from pdserve.prefill_server.load_poller import LoadReportPoller
from pdserve.prefill_server.node import RequestTooLarge
from pdserve.prefill_server.picker import DecodePicker
from pdserve.prefill_server.wiring import build_node
from pdserve.protos import session_pb2 as pb
from pdserve.protos import session_pb2_grpc as pb_grpc
from pdserve.net import free_port

torch.set_num_threads(1)


def _parts(engine):
    from pdserve.cachestore import CompatInfo, KVLayout, MemoryRegion

    kv = engine.kv_cache
    layout = KVLayout(kv.num_layers, kv.num_blocks, kv.block_nbytes)
    compat = CompatInfo("float32", kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size)
    msg = pb.Compat(dtype="float32", num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                    block_size=kv.block_size, model="tiny", transport="tcp")
    return MemoryRegion.from_tensor(kv.tensor), layout, compat, msg


class Pair:
    """A decode service and a prefill node wired together on loopback."""

    async def __aenter__(self):
        loaded = load_model("tiny")
        self.d_engine = AsyncLLMEngine(LLMEngine(loaded, EngineConfig(num_blocks=8)))
        self.p_engine = AsyncLLMEngine(LLMEngine(loaded, EngineConfig(num_blocks=16)))
        await self.d_engine.start()
        await self.p_engine.start()
        region, layout, compat, msg = _parts(self.d_engine.engine)
        self.rx = CacheStoreReceiver(region, layout, compat, "tcp", "127.0.0.1", 0)
        await self.rx.start()
        self.service = build_service(self.d_engine, self.rx, msg, sampling_cls=SamplingParams,
                                     out_of_blocks_error=OutOfBlocksError,
                                     max_model_len=2048, kv_bytes_per_block=layout.block_nbytes * layout.num_layers,
                                     session_timeout_s=5)
        self.server = grpc.aio.server()
        pb_grpc.add_DecodeServicer_to_server(self.service, self.server)
        port = free_port()
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        p_region, p_layout, p_compat, p_msg = _parts(self.p_engine.engine)
        self.tx = CacheStoreSender(p_region, p_layout, p_compat, "tcp")
        await self.tx.start()
        picker = DecodePicker()
        queue = AdmissionQueue(MAX_QUEUED_REQUESTS)
        self.poller = LoadReportPoller(StaticDiscovery([f"127.0.0.1:{port}"]), picker, interval_s=0.1,
                                       on_report=lambda address: queue.notify())
        await self.poller.start()
        self.node = build_node(self.p_engine, self.tx, picker, self.poller, queue, p_msg, block_size=64,
                               kv_bytes_per_block=p_layout.block_nbytes * p_layout.num_layers, eos_token_ids=(257,),
                               out_of_blocks_error=OutOfBlocksError, session_timeout_s=5)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not picker.eligible() and loop.time() < deadline:  # the first load report (slow on a busy machine)
            await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *exc):
        await self.poller.stop()
        await self.server.stop(0)
        await self.tx.stop()
        await self.rx.stop()
        await self.d_engine.stop()
        await self.p_engine.stop()

    def held(self):
        d, p = self.d_engine.engine, self.p_engine.engine
        return {"decode_sessions": len(self.service.sessions), "decode_requests": d.num_requests(),
                "decode_used": d.num_blocks - d.num_free_blocks(), "prefill_sessions": len(self.node.sessions),
                "prefill_requests": p.num_requests(), "prefill_used": p.num_blocks - p.num_free_blocks(),
                "rx_pinned": self.rx.stats()["pinned_entries"], "tx_pinned": self.tx.stats()["pinned_entries"]}

    async def wait_released(self, timeout=2.0):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(self.held().values()) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return self.held()


async def _collect(node, rid, ids, sp):
    out = []
    async for delta in node.generate(rid, ids, sp):
        out += delta.token_ids
        if delta.finished:
            return out, delta.finish_reason
    raise AssertionError("no finished delta")


def test_session_state_machines_in_one_process():
    async def main():
        async with Pair() as pair:
            reqs = [("a", [256, *b"hello"], 9), ("b", [256] + [66] * 100, 5), ("c", [256, 1], 1)]
            results = await asyncio.gather(*(_collect(pair.node, rid, ids, SamplingParams(max_tokens=n, temperature=0))
                                             for rid, ids, n in reqs))
            ref = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=16))
            for rid, ids, n in reqs:
                ref.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0))
            expected = {rid: [] for rid, _, _ in reqs}
            while ref.has_unfinished():
                for out in ref.step():
                    expected[out.request_id] += out.new_token_ids
            assert [r[0] for r in results] == [expected[rid] for rid, _, _ in reqs]
            assert not any((await pair.wait_released()).values()), pair.held()

            # decode has 8 blocks of 64 tokens: 600 prompt + 100 new tokens need 11 -> never fits, no fallback:
            # WRR does not even ask the decode (its load report says 8 in all) and does not queue
            with pytest.raises(RequestTooLarge, match="needs 11 KV blocks .* holds only 8 KV blocks in all"):
                await _collect(pair.node, "big", [256] + [70] * 599, SamplingParams(max_tokens=100, temperature=0))
            assert not any((await pair.wait_released()).values()), pair.held()

            # the client goes away mid-stream: closing the generator cancels the Session
            gen = pair.node.generate("gone", [256, 5], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
            await gen.__anext__()
            await gen.__anext__()
            assert pair.held()["decode_sessions"] == 1
            await gen.aclose()
            held = await pair.wait_released(timeout=1.0)
            assert not any(held.values()), held

    asyncio.run(main())


def test_first_token_leaves_while_the_prefill_engine_thread_is_busy():
    """Once a prompt's KV has left, its first token (with its logprob) goes to the client without another
    trip to the prefill's engine thread: by then that thread is usually computing the next prompt, and a
    trip there (to release the blocks, to read the logprob) held the first token back by that whole prompt.
    Here the engine thread is kept busy right after the prompt by a call that waits on ``gate``; the first
    delta must come while it waits, and the blocks are released once the thread is free again."""
    async def main():
        async with Pair() as pair:
            pd, gate = pair.p_engine.engine.pd, threading.Event()
            add_remote = pd.add_remote

            def add_then_busy(request_id, ids, sampling, on_layer=None, on_done=None, priority=0.0, want=None):
                def done(token, error):  # on the engine thread, in the step that computed the prompt
                    if token is not None:  # "the next prompt", queued behind this one
                        pair.p_engine._calls.put((gate.wait, (30.0,), None))
                    on_done(token, error)
                add_remote(request_id, ids, sampling, on_layer, done, priority, want)

            pd.add_remote = add_then_busy
            gen = pair.node.generate("a", [256, *b"hello"], SamplingParams(max_tokens=4, temperature=0, logprobs=2))
            try:
                first = await asyncio.wait_for(gen.__anext__(), 20.0)
                assert len(first.token_ids) == 1 and first.logprobs and first.logprobs[0] is not None
                assert not gate.is_set() and pair.held()["prefill_used"] > 0  # not released yet: the thread is busy
            finally:
                gate.set()
            rest = [d async for d in gen]
            assert rest[-1].finished
            assert not any((await pair.wait_released()).values()), pair.held()

    asyncio.run(main())


def _count_adds(pd) -> dict[str, int]:
    """Wrap the prefill engine's add_remote: how many times each request id entered its line."""
    adds: dict[str, int] = {}
    add_remote = pd.add_remote

    def counted(request_id, *args, **kw):
        adds[request_id] = adds.get(request_id, 0) + 1
        add_remote(request_id, *args, **kw)

    pd.add_remote = counted
    return adds


def test_a_request_queued_behind_the_busy_prefill_engine_holds_nothing_on_the_decode():
    """The prefill's engine thread is held busy (a call that waits on ``gate``) and its line's window is 8 prompt
    tokens. A first request, with nothing ahead of it, is wanted at once (its decode allocates while the engine
    is busy, as it would during a step); a second one has the first one's prompt ahead of it, more than the
    window, and the Scheduler cannot want it while the engine is busy: no Session is opened for it and the decode
    holds nothing for it. Once the engine is free both are served as usual."""
    async def main():
        async with Pair() as pair:
            pair.node.deps.session_runner.line.line_tokens = 8
            gate = threading.Event()
            pair.p_engine._calls.put((gate.wait, (30.0,), None))
            sp = SamplingParams(max_tokens=3, temperature=0)
            line = pair.node.deps.session_runner.line
            first = asyncio.ensure_future(_collect(pair.node, "first", [256, *b"first in line"], sp))
            await until(lambda: pair.held()["decode_sessions"] == 1, "the first request's Session on the decode")
            second = asyncio.ensure_future(_collect(pair.node, "second", [256, *b"queued"], sp))
            try:
                # the second prompt is in the line, behind more than its window: only the engine thread (blocked at
                # the gate) could want it now, so nothing can have reached the decode for it
                await until(lambda: line.queued_tokens > len(b"first in line") + 1, "the second prompt in the line")
                await settle()
                held = pair.held()
                assert held["decode_sessions"] == held["decode_requests"] == 1, held
                assert list(pair.node.sessions) == ["first"] and not second.done()
            finally:
                gate.set()
            for task in (first, second):
                tokens, reason = await asyncio.wait_for(task, 30)
                assert len(tokens) == 3 and reason == "length"
            assert not any((await pair.wait_released()).values()), pair.held()

    asyncio.run(main())


def test_a_request_the_decode_refused_keeps_its_place_in_the_engines_line():
    """The decode (8 blocks of 64 tokens) is full with one long request. The picker is made to ignore the decode's
    room (as a stale load report would), so a second request, once the prefill's Scheduler wants it, is sent to the
    decode and refused, again and again while the decode stays full; between tries it waits in the admission line
    with its prompt still in the engine's line. When the decode frees, it is served from that same place: its
    prompt entered the engine once, whatever the number of refusals."""
    async def main():
        async with Pair() as pair:
            adds = _count_adds(pair.p_engine.engine.pd)
            runner, picker = pair.node.deps.session_runner, pair.node.deps.picker
            tries: list[str] = []
            run = runner.run
            runner.run = lambda address, session_id, *a, **kw: (tries.append(session_id), run(address, session_id, *a,
                                                                                               **kw))[1]
            hog = asyncio.ensure_future(_collect(pair.node, "hog", [256] + [70] * 300, SamplingParams(
                max_tokens=150, temperature=0, ignore_eos=True)))  # 451 tokens: all 8 blocks
            await until(lambda: pair.held()["decode_used"] == 8, "the long request holding the decode's 8 blocks")
            picker.eligible = lambda exclude=frozenset(), blocks_needed=0: [a for a in picker.usable()
                                                                              if a not in exclude]
            late = asyncio.ensure_future(_collect(pair.node, "late", [256, *b"late"], SamplingParams(
                max_tokens=2, temperature=0)))
            await until(lambda: len([t for t in tries if t.startswith("late")]) >= 2 or late.done(),
                        "two refused tries of the late request")
            assert not late.done() and len([t for t in tries if t.startswith("late")]) >= 2, tries  # refused twice
            assert adds.get("late") == 1  # and still in the engine's line, where it entered once
            await asyncio.wait_for(hog, 60)
            tokens, reason = await asyncio.wait_for(late, 60)
            assert len(tokens) == 2 and reason == "length"
            assert adds == {"hog": 1, "late": 1}, (adds, tries)  # each prompt entered the engine's line once
            assert not any((await pair.wait_released()).values()), pair.held()

    asyncio.run(main())
