"""The choices of one OpenAI request, run as sequences and merged into one stream of
``(choice index, Piece)``.

A request has ``len(prompts) x n`` choices; choice ``p * n + j`` is the j-th sample of prompt
p (OpenAI's and vLLM's numbering). Each choice is its own sequence through the PrefillNode
(its own Session to a decode, its own resume), under the id ``<request id>`` for choice 0
and ``<request id>-c<i>`` for the others; a seeded request gives choice j the seed
``seed + j`` (mod 2**63), so the n samples differ and each is reproducible.

Sharing the prompt (``n`` > 1): the first choice of a prompt starts at once; its siblings
start when it yields its first piece. By then that prompt's full KV blocks sit in this
prefill's prefix cache (its engine registers them when it releases them after the push), so
the siblings' prefills compute only the prompt's last partial block, and a decode that holds
the prompt (its KV events) is preferred for them. The prompt is computed once per prompt,
not n times; the n sequences are not forked inside one decode (each has its own blocks there).
Prompt logprobs (echo with logprobs) are asked by the first choice of each prompt only (it
computes the whole prompt); its siblings show the same ones (``openai_serving.py``).

``merged`` yields every choice's pieces as they come; the first error of any choice cancels
the others (each releases what it holds, as a cancelled single request does) and raises.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import AsyncGenerator, AsyncIterator, Callable

from .closing import aclose_fully
from .frontend import Piece

SEED_MOD = 2**63 - 1


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    sampling: object  # the engine's SamplingParams for this choice


def plan(request_id: str, prompts: list[list[int]], samplings: list, n: int) -> list[Choice]:
    """The choices of a request: ``samplings[p]`` is prompt p's SamplingParams (choice j of it gets seed + j)."""
    out = []
    for p, (ids, sp) in enumerate(zip(prompts, samplings)):
        for j in range(n):
            index = p * n + j
            sp_j = sp
            if j and sp.seed is not None:
                sp_j = replace(sp_j, seed=(sp.seed + j) % SEED_MOD)
            if j and sp.prompt_logprobs is not None:  # the first choice's prompt logprobs serve them all
                sp_j = replace(sp_j, prompt_logprobs=None)
            out.append(Choice(index, p, request_id if index == 0 else f"{request_id}-c{index}", ids, sp_j))
    return out


async def merged(choices: list[Choice],
                 start: Callable[[Choice], AsyncGenerator[Piece, None]]) -> AsyncIterator[tuple[int, Piece]]:
    """``(choice index, piece)`` of every choice until each yielded its finished piece."""
    events: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []
    groups: dict[int, list[Choice]] = {}
    for c in choices:
        groups.setdefault(c.prompt_index, []).append(c)

    async def pump(c: Choice) -> None:
        pieces = start(c)
        group = groups[c.prompt_index]
        siblings = group[1:] if c is group[0] else []
        try:
            async for piece in pieces:
                for sibling in siblings:  # the prompt's blocks are cached now: its other choices may start
                    tasks.append(asyncio.ensure_future(pump(sibling)))
                siblings = []
                events.put_nowait((c.index, piece, None))
                if piece.finished:  # close it here (shielded): a cancel must not cut its teardown short
                    break
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            events.put_nowait((c.index, None, exc))
        finally:
            await aclose_fully(pieces)

    try:
        tasks.extend(asyncio.ensure_future(pump(group[0])) for group in groups.values())
        unfinished = len(choices)
        while unfinished:
            index, piece, exc = await events.get()
            if exc is not None:
                raise exc
            if piece.finished:
                unfinished -= 1
            yield index, piece
    finally:
        for t in tasks:  # choices still running (after an error, or the client went away)
            t.cancel()
        if tasks:
            # each cancelled choice releases what it holds; a second cancel (ours) must not cut that short
            gathering = asyncio.gather(*tasks, return_exceptions=True)
            try:
                await asyncio.shield(gathering)
            except asyncio.CancelledError:
                await asyncio.wait({gathering})
                raise
