"""DecodeEngine: the engine calls a decode Session makes (reserve -> add_prefilled -> release),
and the Sampling message turned into the engine's SamplingParams. Built once by DecodeService
and handed to every DecodeSession in SessionDeps."""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

from pdserve.protos import session_pb2 as pb

if TYPE_CHECKING:
    from pdserve.engine import AsyncLLMEngine, RequestOutput


def sampling_from_proto(msg: pb.Sampling, sampling_cls):
    return sampling_cls(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None, stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
    )


class DecodeEngine:
    """The engine calls a DecodeSession makes."""

    def __init__(self, engine: AsyncLLMEngine, sampling_cls):
        self.engine, self.sampling_cls = engine, sampling_cls

    @property
    def num_blocks(self) -> int:
        return self.engine.num_blocks

    async def reserve(self, request_id: str, n_prompt: int, max_tokens: int) -> list[int]:
        return await self.engine.reserve(request_id, n_prompt, max_tokens)

    def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int,
                      sampling: pb.Sampling) -> AsyncIterator[RequestOutput]:
        return self.engine.add_prefilled(request_id, prompt_ids, first_token,
                                         sampling_from_proto(sampling, self.sampling_cls))

    async def release(self, request_id: str) -> None:
        """Free everything the engine holds for the request: reserved blocks or a running sequence."""
        await self.engine.abort(request_id)
