"""DecodeEngine: the engine calls a decode Session makes (reserve -> add_prefilled or
prefill_reserved -> release); the Sampling message
turned into the engine's SamplingParams; and the measured speed of the prompts this decode
computed itself (``computed_prompt`` -> ``prefill_rate()``, reported in every LoadReport).
Built once by ``wiring.build_service`` and handed to every DecodeSession in SessionDeps."""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncGenerator

from pdserve.engine.grammar import GrammarSpec
from pdserve.protos import session_pb2 as pb
from pdserve.rate_meter import RateMeter

if TYPE_CHECKING:
    from pdserve.engine import RequestOutput, SamplingParams
    from pdserve.engine.server_engine import ServerEngine

    from .lso import LsoController
    from .session_metrics import SessionMetrics


def sampling_from_proto(msg: pb.Sampling, sampling_cls: type[SamplingParams]):
    return sampling_cls(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None, stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        grammar=GrammarSpec(msg.grammar.kind, msg.grammar.schema or None, msg.grammar.feed)
        if msg.HasField("grammar") else None, seed_position=msg.seed_position,
    )


class DecodeEngine:
    """The engine calls a DecodeSession makes."""

    def __init__(self, engine: ServerEngine, sampling_cls: type[SamplingParams], metrics: SessionMetrics,
                 lso: LsoController | None = None):
        self.engine, self.sampling_cls, self.metrics, self.lso = engine, sampling_cls, metrics, lso
        self.local_prompts = RateMeter()  # tokens/s of the prompts computed here (ComputePrompt)

    def track(self, request_id: str, start: pb.Start) -> None:
        """The request joins the batch: its TBT target / evictability for the LSO controller."""
        if self.lso is not None:
            self.lso.track(request_id, start.tbt_target_ms, start.evictable)

    @property
    def num_blocks(self) -> int:
        return self.engine.num_blocks

    async def reserve(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                      reuse_prefix: bool) -> tuple[list[int], int]:
        """Blocks for prompt + max_tokens and the prompt tokens whose KV the leading ones already
        hold (0 unless ``reuse_prefix``: then the longest cached prefix, pinned until release)."""
        if reuse_prefix:
            block_ids, cached = await self.engine.reserve_prefix(request_id, prompt_ids, max_tokens)
        else:
            block_ids, cached = await self.engine.reserve(request_id, len(prompt_ids), max_tokens), 0
        return block_ids, cached

    def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int,
                      sampling: pb.Sampling) -> AsyncGenerator[RequestOutput, None]:
        return self.engine.add_prefilled(request_id, prompt_ids, first_token,
                                         sampling_from_proto(sampling, self.sampling_cls))

    def prefill_reserved(self, request_id: str, prompt_ids: list[int],
                         sampling: pb.Sampling) -> AsyncGenerator[RequestOutput, None]:
        return self.engine.prefill_reserved(request_id, prompt_ids, sampling_from_proto(sampling, self.sampling_cls))

    def computed_prompt(self, tokens: int, seconds: float) -> None:
        """A prompt computed here (``tokens`` after its cached prefix) gave its first output after ``seconds``."""
        self.local_prompts.add(tokens, seconds)
        self.metrics.prefill_rate(self.local_prompts.rate())

    def prefill_rate(self) -> float:
        """Measured tokens/s of the prompts computed here; 0.0 before the first one."""
        return self.local_prompts.rate() or 0.0

    async def release(self, request_id: str) -> None:
        """Free everything the engine holds for the request: reserved blocks, a running sequence
        or one evicted to host memory."""
        if self.lso is not None:
            self.lso.untrack(request_id)
        await self.engine.abort(request_id)
