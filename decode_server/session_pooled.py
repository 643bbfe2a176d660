"""The pooled path's steps of a DecodeSession (``pdserve decode --kv-pool``): a request whose KV
does not fit the blocks free here.

- **allocate** (``_open_pooled``, from step 2 when the engine has no room): local blocks plus
  loans (``PooledDecode.open``), then an Allocation that says ``pooled`` and lists where each
  part of the prompt's KV goes: our leading blocks, then each lender's (the prefill pushes them
  there); or, when not one prompt block fits here, none: the prefill answers ComputePrompt and
  the prompt is computed here;
- **KV in** (``_pooled_kv_in``, step 3): the lenders' parts must arrive too;
- **decode** (``_decode_pooled``, step 4): the pooled request's greedy tokens;
- step 5 (session.py) closes the PooledDecode: its loans and local blocks are released.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pdserve.kvpool.errors import LenderLost
from pdserve.protos import session_pb2 as pb

from .pooled_decode import PooledDecode
from .registry import SessionInfo
from .session_deps import SessionDeps
from .session_stream import SessionEnded, SessionStream

if TYPE_CHECKING:
    from pdserve.kvpool.decode_pool import DecodePool

log = logging.getLogger("pdserve.decode_server.session")


class PooledSteps(SessionStream):
    """DecodeSession's pooled-path methods (it sets ``deps``, ``info``, ``pooled``, ``expected``, ``outcome``)."""

    deps: SessionDeps
    info: SessionInfo | None
    pooled: PooledDecode | None
    expected: bool
    outcome: tuple[str, str]

    async def _open_pooled(self, pool: DecodePool, start: pb.Start, why_not_local: str) -> tuple[str, str] | None:
        """Step 2 on the pooled path: local blocks + loans, then the pooled Allocation; the
        refusal when the pool has no room either (transient, like out_of_blocks here)."""
        deps, rid = self.deps, start.request_id
        timeout = min(start.timeout_s or deps.session_timeout_s, deps.session_timeout_s)
        try:
            self.pooled = pooled = await PooledDecode.open(pool, start, timeout)
        except deps.out_of_blocks_error as exc:
            return "out_of_blocks", f"{why_not_local}; the KV pool: {exc}"
        except LenderLost as exc:  # while lending: nothing is held
            return "out_of_blocks", f"{why_not_local}; the KV pool: {exc}"
        self.info = SessionInfo(rid, "allocate", num_blocks=pooled.local_blocks)
        deps.registry.add(self.info)
        log.info("session %s: pooled (%d local blocks, loans from %s; the prompt's KV %s)", rid,
                 pooled.local_blocks, ", ".join(f"{l.lender}: {l.blocks}" for l in pooled.request.loans)
                 or "nobody", "pushed by prefill" if pooled.pushed else "computed here")
        allocation = pb.Allocation(cachestore_endpoint=deps.receiver.endpoint, pooled=True)
        if pooled.pushed:
            dst = deps.receiver.expect(rid, pooled.local_prompt_blocks(), timeout)
            allocation.block_ids.extend(dst)
            allocation.kv_token = dst.token
            self.expected = True
            allocation.pool_targets.extend(pooled.targets)
        await self.write(allocation=allocation)
        return None

    async def _pooled_kv_in(self, pooled: PooledDecode, timeout: float) -> None:
        try:
            await pooled.kv_arrived(timeout)
        except LenderLost as exc:
            raise SessionEnded(str(exc)) from None

    async def _decode_pooled(self, pooled: PooledDecode, start: pb.Start, first_token: int | None = None) -> None:
        """Step 4 on the pooled path: stream the pooled request's greedy tokens (after
        ``first_token`` when the prefill computed the prompt)."""
        produced, max_tokens = 0 if first_token is None else 1, start.sampling.max_tokens
        try:
            async for token in pooled.tokens(start.sampling, first_token):
                produced += 1
                await self.write(tokens=pb.Tokens(token_ids=[token]))
        except LenderLost as exc:  # part of the KV is gone with its lender
            raise SessionEnded(str(exc)) from None
        reason = "length" if produced >= max_tokens else "stop"
        await self.write_finish(reason, produced)
        self.outcome = ("ok", reason)
