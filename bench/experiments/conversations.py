"""Multi-turn chat traffic for the prefix experiment: a shared system prompt, conversations whose
every turn appends to the history, sent as token ids (``/v1/completions``).

Turn t of a conversation sends ``system + (user_1 + reply_1) + ... + user_t``: what a chat
client sends back, with a fixed stand-in for each assistant reply (the reply the client got is
not what the next prompt must hold for this experiment: what matters is that each turn's
prompt starts with the previous turn's prompt). Conversations start at Poisson times; each
next turn is sent ``think_s`` after the previous answer ended (closed loop per conversation),
so every policy gets the same starts, the same prompts and the same think times.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from pdserve.bench.loadgen import LoadConfig, send_one
from pdserve.bench.loadgen_report import RequestResult
from pdserve.bench.loadgen_workload import RequestSpec, arrival_times, make_prompt_ids


@dataclass(frozen=True)
class ChatTrace:
    system: tuple[int, ...]
    turns: list[list[tuple[tuple[int, ...], tuple[int, ...]]]]  # per conversation: (user ids, reply ids) per turn
    starts: list[float]
    think_s: float
    output_tokens: int

    def prompt(self, conversation: int, turn: int) -> tuple[int, ...]:
        ids = list(self.system)
        for user, reply in self.turns[conversation][:turn]:
            ids += user + reply
        return tuple(ids + list(self.turns[conversation][turn][0]))

    @property
    def max_prompt_tokens(self) -> int:
        return max(len(self.prompt(c, len(t) - 1)) for c, t in enumerate(self.turns))

    @property
    def requests(self) -> int:
        return sum(len(t) for t in self.turns)


def chat_trace(conversations: int, turns: int, system_tokens: int, user_tokens: int, reply_tokens: int,
               output_tokens: int, rate: float, think_s: float, vocab: int, seed: int = 7) -> ChatTrace:
    for name, value in (("conversations", conversations), ("turns", turns), ("system_tokens", system_tokens),
                        ("user_tokens", user_tokens), ("output_tokens", output_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if reply_tokens < 0 or think_s < 0 or rate <= 0:
        raise ValueError("reply_tokens and think_s must be >= 0 and rate > 0")
    rng = random.Random(seed)
    system = make_prompt_ids(system_tokens, rng, vocab)
    convs = [[(make_prompt_ids(user_tokens, rng, vocab),
               make_prompt_ids(reply_tokens, rng, vocab) if reply_tokens else ())
              for _ in range(turns)] for _ in range(conversations)]
    return ChatTrace(system, convs, arrival_times(conversations, rate, "poisson", random.Random(seed + 1)), think_s,
                     output_tokens)


@dataclass
class TurnResult:
    conversation: int
    turn: int
    result: RequestResult


async def _drive(config: LoadConfig, trace: ChatTrace) -> tuple[list[TurnResult], float]:
    import aiohttp

    out: list[TurnResult] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def conversation(c: int) -> None:
            await asyncio.sleep(max(0.0, t0 + trace.starts[c] - time.perf_counter()))
            for t in range(len(trace.turns[c])):
                ids = trace.prompt(c, t)
                spec = RequestSpec(len(ids), trace.output_tokens, prompt_ids=ids)
                result = await send_one(session, config, spec, RequestResult(len(out), len(ids), trace.output_tokens),
                                        t0)
                out.append(TurnResult(c, t, result))
                if not result.ok:
                    return  # a conversation whose turn failed ends there (counted as failed)
                await asyncio.sleep(trace.think_s)

        await asyncio.gather(*(conversation(c) for c in range(len(trace.turns))))
        return out, time.perf_counter() - t0


def send_conversations(url: str, model: str, trace: ChatTrace,
                       timeout: float = 600.0) -> tuple[list[TurnResult], float]:
    """Run the trace against an OpenAI endpoint; every turn's result and the wall time."""
    config = LoadConfig(url=url, model=model, progress=False, request_timeout=timeout)
    return asyncio.run(_drive(config, trace))
