"""Router: one decision per request, from the index and the prefills' loads.

``decide(prompt_ids)`` hashes the prompt's reusable blocks (per block size the prefills
report; each block only when a lookup reaches it: the longest match + 1), asks the PrefixIndex
how many leading blocks each routable prefill holds, and
hands the candidates to ``choice.choose``. The load it uses for a prefill is the larger of
its last report's requests in flight and the requests this router is relaying to it now
(a burst counts before the next report). ``count_decision`` records the metrics once the
request is on its way. ``decide_waiting`` decides once a prefill can take the request (a
rollout's gap: none is routable, or those that are refused it for want of a decode), or
gives up at a deadline. With ``policy="round-robin"`` (the experiments' baseline) the
candidates go to ``choice.round_robin`` instead, in turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from pdserve.engine.block_manager import reusable_blocks
from pdserve.kv_index import PrefixIndex

from .choice import Candidate, Choice, choose, round_robin
from .prefills import PrefillSet
from .prompt import lazy_prompt_hashes, prompt_key

log = logging.getLogger(__name__)
WAIT_POLL_S = 0.05  # how often a request waiting for a prefill that can take it looks again


class Router:
    POLICIES = ("prefix", "round-robin")

    def __init__(self, prefills: PrefillSet, index: PrefixIndex, tokenizer, metrics=None, load_weight: float = 64.0,
                 policy: str = "prefix"):
        if policy not in self.POLICIES:
            raise ValueError(f"policy must be one of {self.POLICIES}, got {policy!r}")
        self.prefills, self.index, self.tokenizer = prefills, index, tokenizer
        self.metrics, self.load_weight, self.policy = metrics, load_weight, policy
        self._turn = 0

    def decide(self, prompt_ids: list[int] | None, preview: bool = False) -> Choice | None:
        """The prefill for a prompt (None: the body could not be read; routed by load), or None if none is routable.
        ``preview``: the decision only (round robin does not advance)."""
        watches = self.prefills.routable()
        if not watches:
            return None
        ids = prompt_ids or []
        hashes: dict[int, Iterable[int]] = {}  # per block size: hashed as far as the lookups read
        candidates = []
        for w in watches:
            load = w.load
            if load is None:  # (routable: it has one)
                continue
            bs = load.block_size or 1
            if bs not in hashes:
                hashes[bs] = lazy_prompt_hashes(ids, bs) if ids else []
            candidates.append(Candidate(w.address, self.index.overlap(w.address, hashes[bs]),
                                        max(load.in_flight, w.in_flight), load.kv_blocks_free, bs))
        if self.policy == "round-robin":
            turn = self._turn
            self._turn += 0 if preview else 1
            return round_robin(candidates, turn)
        first_bs = candidates[0].block_size
        return choose(candidates, len(ids), prompt_key(ids, first_bs), self.load_weight)

    async def decide_waiting(self, prompt_ids: list[int] | None, until: float,
                             refused: dict[str, float] | None = None, exclude=()) -> Choice | None:
        """``decide`` once a prefill is routable that has not refused this request since its last load report
        (``refused``: prefill -> when) and is not in ``exclude`` (failed it), or None at ``until`` (monotonic):
        a rollout or a restart can leave a few seconds with none."""
        refused = refused or {}
        while time.monotonic() < until:
            await asyncio.sleep(max(0.0, min(WAIT_POLL_S, until - time.monotonic())))
            choice = self.decide(prompt_ids)
            watches = self.prefills.watches
            if choice is not None and any(a in watches and a not in exclude and not refusing(watches[a], refused)
                                          for a in choice.ranking):
                return choice
        return None

    def count_decision(self, address: str, reason: str, choice: Choice, prompt_ids: list[int] | None) -> None:
        log.debug("route -> %s (%s, %d cached blocks)", address, reason, choice.overlap_blocks)
        if self.metrics is None:
            return
        self.metrics.router_decisions.labels(prefill=address, reason=reason).inc()
        watch = self.prefills.watches.get(address)
        if prompt_ids and watch is not None and watch.load is not None:
            self.metrics.router_prompt_blocks.inc(reusable_blocks(len(prompt_ids), watch.load.block_size or 1))
            if address == choice.address:
                self.metrics.router_prefix_hit_blocks.inc(choice.overlap_blocks)

    def state(self) -> dict:
        return {address: w.state() for address, w in sorted(self.prefills.watches.items())}


def refusing(watch, refused: dict[str, float]) -> bool:
    """The prefill refused this request for want of a decode and has not reported its load since."""
    at = refused.get(watch.address)
    return at is not None and watch.load_at <= at
