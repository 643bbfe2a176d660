"""SessionDeps: what every DecodeSession is given, built once by ``wiring.build_service`` (never the service itself)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.protos import session_pb2 as pb
from pdserve.test_hooks import NO_GATES, TestGates

from .registry import SessionRegistry
from .session_metrics import SessionMetrics

if TYPE_CHECKING:
    from pdserve.cachestore import CacheStoreReceiver
    from pdserve.kvpool.decode_pool import DecodePool

    from .decode_engine import DecodeEngine
    from .rank_receivers import RankReceivers


class KVArrival(Protocol):
    """Where one request's KV lands: the CacheStore receiver, or every rank's (``rank_receivers.RankArrival``)."""

    async def load(self, request_id: str, layer: int, timeout_s: float) -> None: ...
    async def wait_all(self, request_id: str, timeout_s: float) -> None: ...
    def delete(self, request_id: str) -> None: ...
    async def released(self, request_id: str, timeout_s: float) -> None: ...


@dataclass(frozen=True, slots=True)
class SessionDeps:
    """Everything a DecodeSession uses, built once by ``wiring.build_service`` and held by the DecodeService."""

    engine: DecodeEngine  # reserve / add_prefilled / prefill_reserved / release; num_blocks
    receiver: CacheStoreReceiver  # expect / wait_all / load / delete / released; endpoint
    registry: SessionRegistry  # live sessions, draining flag, layer arrivals
    metrics: SessionMetrics
    compat: pb.Compat  # ours: Start's must match
    max_model_len: int
    session_timeout_s: float  # a cap on the timeout prefill asks for in Start
    out_of_blocks_error: type[Exception]  # the engine's OutOfBlocksError (refused as out_of_blocks)
    pool: DecodePool | None = None  # --kv-pool: lend to peers, borrow for requests too big for our free blocks
    gates: TestGates = NO_GATES  # test hooks (pdserve/test_hooks.py), read once by the wiring
    ranks: RankReceivers | None = None  # the per-rank push's receivers (rank_receivers.py); None: not offered
