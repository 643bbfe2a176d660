"""DecodeService: the gRPC ``Decode`` service of a decode process (Session + GetLoadReport).

It owns the registry of live sessions, the draining flag and the adapters between the
Session stream and the engine (``reserve`` / ``add_prefilled`` / ``abort`` / ``release``)
and the CacheStore receiver. Each Session call is run by a ``DecodeSession``
(decode_server/session.py, which lists the request lifecycle).
"""

from __future__ import annotations

import logging

import grpc

from pdserve.protos import session_pb2 as pb
from pdserve.protos import session_pb2_grpc as pb_grpc
from pdserve.protos.version import PROTOCOL_VERSION

from .session import DecodeSession, SessionInfo

log = logging.getLogger(__name__)


def sampling_from_proto(msg: pb.Sampling, sampling_cls):
    return sampling_cls(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None, stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
    )


class DecodeService(pb_grpc.DecodeServicer):
    def __init__(self, engine, receiver, compat: pb.Compat, *, sampling_cls, out_of_blocks_error,
                 max_model_len: int, kv_bytes_per_block: int, session_timeout_s: float = 30.0, metrics=None):
        self.engine, self.receiver, self.compat = engine, receiver, compat
        self.llm = engine.engine  # the LLMEngine: read-only queries (free blocks) from this thread
        self.sampling_cls, self.out_of_blocks_error = sampling_cls, out_of_blocks_error
        self.max_model_len, self.kv_bytes_per_block = max_model_len, kv_bytes_per_block
        self.session_timeout_s, self.metrics = session_timeout_s, metrics
        self.sessions: dict[str, SessionInfo] = {}
        self.draining = False
        self.layer_arrivals: dict[str, list[float]] = {}  # recent requests only, for /debug/requests

    def remember_arrivals(self, request_id: str, times: list[float]) -> None:
        self.layer_arrivals[request_id] = times
        while len(self.layer_arrivals) > 256:
            self.layer_arrivals.pop(next(iter(self.layer_arrivals)))

    # -- engine adapters (DecodeSession calls these) ---------------------------------------
    async def reserve(self, request_id: str, n_prompt: int, max_tokens: int) -> list[int]:
        block_ids = await self.engine.reserve(request_id, n_prompt, max_tokens)
        self._gauge_blocks()
        return block_ids

    def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int, sampling: pb.Sampling):
        return self.engine.add_prefilled(request_id, prompt_ids, first_token, sampling_from_proto(sampling, self.sampling_cls))

    async def release(self, request_id: str) -> None:
        """Free everything the engine holds for the request: reserved blocks or a running sequence."""
        await self.engine.abort(request_id)
        self._gauge_blocks()

    def metrics_refusal(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_allocation_refusals.labels(reason=code).inc()

    def observe_kv_in(self, seconds: float, n_prompt: int) -> None:
        """All KV layers and the first token are in, ``seconds`` after the allocation."""
        if self.metrics is not None:
            self.metrics.decode_last_layer_wait.observe(seconds)
            blocks = -(-n_prompt // self.compat.block_size)
            self.metrics.kv_transfer_bytes.inc(blocks * self.kv_bytes_per_block)

    def count_request(self, outcome: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(outcome=outcome, reason=reason).inc()
            running = sum(1 for s in self.sessions.values() if s.stage == "decode")
            self.metrics.requests_running.set(running)
            self.metrics.requests_waiting.set(len(self.sessions) - running)

    def _gauge_blocks(self) -> None:
        if self.metrics is not None:
            free = self.llm.num_free_blocks()
            self.metrics.kv_blocks_free.set(free)
            self.metrics.kv_blocks_used.set(self.llm.num_blocks - free)

    # -- gRPC -----------------------------------------------------------------------------
    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        await DecodeSession(self, context).run()

    async def GetLoadReport(self, request: pb.LoadReportRequest, context) -> pb.LoadReport:
        return self.load_report()

    def load_report(self) -> pb.LoadReport:
        free = self.llm.num_free_blocks()
        running = sum(1 for s in self.sessions.values() if s.stage == "decode")
        return pb.LoadReport(
            free_blocks=free, total_blocks=self.llm.num_blocks, free_bytes=free * self.kv_bytes_per_block,
            running=running, waiting=len(self.sessions) - running,
            protocol_version=PROTOCOL_VERSION, model=self.compat.model, draining=self.draining,
            transport=self.compat.transport,
        )

    def counts(self) -> dict:
        """For /health and the failure tests: everything that must return to zero."""
        free = self.llm.num_free_blocks()
        stages: dict[str, int] = {}
        for info in list(self.sessions.values()):
            stages[info.stage] = stages.get(info.stage, 0) + 1
        return {
            "sessions": len(self.sessions),
            "session_stages": stages,
            "engine_requests": self.llm.num_requests(),
            "kv_blocks_total": self.llm.num_blocks,
            "kv_blocks_free": free,
            "kv_blocks_used": self.llm.num_blocks - free,
            "cachestore": self.receiver.stats(),
            "draining": self.draining,
        }
